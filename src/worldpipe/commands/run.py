"""`worldpipe train` and `worldpipe evaluate`."""

from __future__ import annotations

import json
from pathlib import Path

from worldpipe.atomic import write_text_atomic


def register(sub) -> None:
    train = sub.add_parser("train", help="train under torchrun (Hydra overrides follow, e.g. trainer.steps=100)")
    train.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    train.set_defaults(handler=_train, accepts_overrides=True)

    ev = sub.add_parser("evaluate", help="open-loop prediction error vs the repeat-last-observation baseline")
    ev.add_argument("--checkpoints", required=True, help="checkpoint directory of the run")
    ev.add_argument("--store", required=True, help="held-out trajectory store (path or URL)")
    ev.add_argument("--manifest", required=True, help="held-out dataset manifest.json")
    ev.add_argument("--context", type=int, default=8)
    ev.add_argument("--horizon", type=int, default=16)
    ev.add_argument("--out", required=True, help="metrics JSON to write")
    ev.add_argument("--plot", help="error-vs-horizon PNG to write")
    ev.set_defaults(handler=_evaluate)


def _train(args) -> int:
    from worldpipe.launch import launch_training, main_env_endpoint

    return launch_training(args.overrides, main_env_endpoint())


def _evaluate(args) -> int:
    from worldpipe.evaluate import evaluate, plot_error_vs_horizon

    result = evaluate(args.checkpoints, args.store, args.manifest, args.context, args.horizon)
    write_text_atomic(Path(args.out), json.dumps(result, indent=2))
    if args.plot:
        plot_error_vs_horizon(result, args.plot)
    print(f"one-step MSE ratio (model / repeat-last): {result['one_step_ratio']:.4f} over {result['segments']} segments")
    return 0

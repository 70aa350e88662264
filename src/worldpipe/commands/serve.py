"""`worldpipe serve RUN` (HTTP rollout service) and `worldpipe rollout RUN` (one request)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from worldpipe.commands import RUN_HELP, command, locate, pin_recorded_numerics, run_argument


def register(cli: click.Group) -> None:
    def opt(name: str, kind: type, default, help_text: str | None = None) -> click.Option:
        return click.Option([name], type=kind, default=default, show_default=True, help=help_text)

    cli.add_command(command("serve", _serve, "Serve imagination rollouts of the newest loadable checkpoint over "
                            f"HTTP.\n\nRUN: {RUN_HELP}; resolved once at start (without a step: the newest "
                            "loadable step, and newer ones of the same run with --poll-s or POST /reload).", [
        run_argument(),
        opt("--host", str, "127.0.0.1"),
        opt("--port", int, 8000, "0 picks a free port (see --port-file)"),
        click.Option(["--port-file"], help="write the bound port here once listening"),
        opt("--max-batch", int, 16, "requests per batch (1: no batching)"),
        opt("--max-wait-ms", float, 2.0, "how long a batch waits to fill"),
        opt("--max-horizon", int, 256), opt("--max-context", int, 256),
        opt("--max-request-bytes", int, 1 << 20), opt("--cache-entries", int, 4096), opt("--cache-mb", float, 64.0),
        opt("--session-budget-mb", float, 64.0, "memory budget of all session state"),
        opt("--session-idle-s", float, 600.0, "close sessions idle this long"),
        opt("--poll-s", float, 0.0, "look for a newer step of the same run this often; 0: serve the version "
                                    "resolved at start until POST /reload or a restart"),
        opt("--threads", int, 1, "torch intra-op threads"),
        click.Option(["--heldout-store"], help="held-out trajectory store (as `worldpipe evaluate --store`): the "
                                               "play page (GET /play) starts sessions from its windows"),
        click.Option(["--heldout-manifest"], help="its manifest.json (as `worldpipe evaluate --manifest`)"),
    ], short="serve imagination rollouts of the newest loadable checkpoint over HTTP"))
    cli.add_command(command("rollout", _rollout, "Imagine one trajectory from a checkpoint (JSON request in, JSON "
                            f"out).\n\nRUN: {RUN_HELP} (without a step: the newest loadable step).", [
        run_argument(),
        click.Option(["--request"], required=True, help="JSON file with context.obs, context.action, actions, "
                                                        "sampling, rng (as POST /rollout)"),
        click.Option(["--out"], help="write the result JSON here (default: stdout)"),
    ], short="imagine one trajectory from a checkpoint (JSON request in, JSON out)"))


def _config(args):
    from worldpipe.core.errors import UsageError
    from worldpipe.rollout.batcher import BatchPolicy
    from worldpipe.rollout.service import Limits, ServiceConfig

    for name in ("max_batch", "max_horizon", "max_context", "max_request_bytes", "cache_entries", "threads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_wait_ms", "cache_mb", "session_budget_mb", "session_idle_s", "poll_s"):
        if not getattr(args, name) >= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return ServiceConfig(BatchPolicy(args.max_batch, args.max_wait_ms / 1000),
                         Limits(args.max_horizon, args.max_context, args.max_request_bytes),
                         args.cache_entries, int(args.cache_mb * 2**20), int(args.session_budget_mb * 2**20),
                         args.session_idle_s, args.poll_s)


def _serve(args) -> int:
    from worldpipe.core.errors import UsageError
    from worldpipe.rollout.contexts import HeldoutContexts

    # The options first, then the held-out data (read, not computed on), then RUN: cheapest refusal first.
    config = _config(args)
    if (args.heldout_store is None) != (args.heldout_manifest is None):
        raise UsageError("--heldout-store and --heldout-manifest go together (the held-out dataset and its manifest)")
    contexts = HeldoutContexts.load(args.heldout_store, args.heldout_manifest) if args.heldout_store else None
    where = locate(args)
    pin_recorded_numerics(where)  # the served run's code paths, before torch computes
    import torch

    from worldpipe.rollout.http.server import serve

    torch.set_num_threads(args.threads)
    return serve(where.path, args.host, args.port, config, args.port_file, contexts=contexts)


def _rollout(args) -> int:
    from worldpipe.core.errors import UsageError

    try:  # before the service's imports: the cheapest refusal first
        request = Path(args.request).read_text()
    except OSError as err:
        raise UsageError(f"--request {args.request}: cannot read it ({err.strerror})") from None
    from pydantic import ValidationError

    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.rollout.engine import Sampling
    from worldpipe.rollout.http.app import as_matrix, jsonable
    from worldpipe.rollout.http.schemas import RolloutIn
    from worldpipe.rollout.service import InputError, RolloutService, ServiceConfig

    try:
        body = RolloutIn.model_validate_json(request)
    except ValidationError as err:
        first = err.errors()[0]
        raise UsageError(f"{args.request}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    service = RolloutService(locate(args).path, ServiceConfig(poll_s=3600))
    try:
        result = service.rollout(as_matrix(body.context.obs, ("context", "obs")),
                                 as_matrix(body.context.action, ("context", "action")),
                                 as_matrix(body.actions, ("actions",)),
                                 Sampling(body.sampling.mode, body.sampling.noise_scale),
                                 body.rng.seed, body.rng.stream, body.model_version)
    except InputError as err:
        raise UsageError(f"{args.request}: {err}") from None
    finally:
        service.close()
    text = json.dumps(jsonable(result), indent=1)
    if args.out:
        write_text_atomic(Path(args.out), text + "\n")
    else:
        print(text)
    return 0

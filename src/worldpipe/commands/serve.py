"""`worldpipe serve CHECKPOINT_DIR` (HTTP rollout service) and `worldpipe rollout CHECKPOINT` (one request)."""

from __future__ import annotations

import json
import sys
from argparse import ArgumentDefaultsHelpFormatter
from pathlib import Path


def register(sub) -> None:
    srv = sub.add_parser("serve", help="serve imagination rollouts of the newest loadable checkpoint over HTTP",
                         formatter_class=ArgumentDefaultsHelpFormatter)
    srv.add_argument("checkpoint_dir", help="checkpoints/ of a run, resolved once at start (or one step-NNNNNN directory)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    srv.add_argument("--port-file", help="write the bound port here once listening")
    srv.add_argument("--max-batch", type=int, default=16, help="requests per batch (1: no batching)")
    srv.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a batch waits to fill")
    srv.add_argument("--max-horizon", type=int, default=256)
    srv.add_argument("--max-context", type=int, default=256)
    srv.add_argument("--max-request-bytes", type=int, default=1 << 20)
    srv.add_argument("--cache-entries", type=int, default=4096)
    srv.add_argument("--cache-mb", type=float, default=64)
    srv.add_argument("--session-budget-mb", type=float, default=64, help="memory budget of all session state")
    srv.add_argument("--session-idle-s", type=float, default=600, help="close sessions idle this long")
    srv.add_argument("--poll-s", type=float, default=0.0,
                     help="look for a newer step of the same run this often; 0: serve the version resolved at "
                          "start until POST /reload or a restart")
    srv.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    srv.set_defaults(handler=_serve)

    ro = sub.add_parser("rollout", help="imagine one trajectory from a checkpoint (JSON request in, JSON out)")
    ro.add_argument("checkpoint", help="checkpoints/ of a run (newest loadable) or one step-NNNNNN directory")
    ro.add_argument("--request", required=True,
                    help="JSON file with context.obs, context.action, actions, sampling, rng (as POST /rollout)")
    ro.add_argument("--out", help="write the result JSON here (default: stdout)")
    ro.set_defaults(handler=_rollout)


def _config(args):
    from worldpipe.rollout.batcher import BatchPolicy
    from worldpipe.rollout.service import Limits, ServiceConfig

    for name in ("max_batch", "max_horizon", "max_context", "max_request_bytes", "cache_entries", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_wait_ms", "cache_mb", "session_budget_mb", "session_idle_s", "poll_s"):
        if not getattr(args, name) >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return ServiceConfig(BatchPolicy(args.max_batch, args.max_wait_ms / 1000),
                         Limits(args.max_horizon, args.max_context, args.max_request_bytes),
                         args.cache_entries, int(args.cache_mb * 2**20), int(args.session_budget_mb * 2**20),
                         args.session_idle_s, args.poll_s)


def _serve(args) -> int:
    import torch

    from worldpipe.checkpoint import CheckpointError
    from worldpipe.core.errors import EXIT_USAGE, one_line
    from worldpipe.rollout.http.server import serve

    try:
        config = _config(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    torch.set_num_threads(args.threads)
    try:
        return serve(args.checkpoint_dir, args.host, args.port, config, args.port_file)
    except CheckpointError as err:  # nothing to serve in CHECKPOINT_DIR: the argument is what must change
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE


def _rollout(args) -> int:
    from pydantic import ValidationError

    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.rollout.engine import Sampling
    from worldpipe.rollout.http.app import as_matrix, jsonable
    from worldpipe.rollout.http.schemas import RolloutIn
    from worldpipe.rollout.service import InputError, RolloutService, ServiceConfig

    try:
        body = RolloutIn.model_validate_json(Path(args.request).read_text())
    except ValidationError as err:
        first = err.errors()[0]
        print(f"error: {args.request}: {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    service = RolloutService(args.checkpoint, ServiceConfig(poll_s=3600))
    try:
        result = service.rollout(as_matrix(body.context.obs, ("context", "obs")),
                                 as_matrix(body.context.action, ("context", "action")),
                                 as_matrix(body.actions, ("actions",)),
                                 Sampling(body.sampling.mode, body.sampling.noise_scale),
                                 body.rng.seed, body.rng.stream, body.model_version)
    except InputError as err:
        print(f"error: {args.request}: {err}", file=sys.stderr)
        return 2
    finally:
        service.close()
    text = json.dumps(jsonable(result), indent=1)
    if args.out:
        write_text_atomic(Path(args.out), text + "\n")
    else:
        print(text)
    return 0

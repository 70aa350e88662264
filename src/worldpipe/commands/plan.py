"""`worldpipe plan experiment=... world_size=N [memory_mb=M] [--json]`: predict and rank the parallel layouts."""

from __future__ import annotations

import json

from worldpipe.core.provenance import PROJECT_ROOT


def register(sub) -> None:
    plan = sub.add_parser("plan", help="predict per-rank memory and communication of every layout in conf/parallel/")
    plan.add_argument("--json", action="store_true", help="print the predictions as JSON")
    plan.add_argument("--env", default="Pendulum-v1", help="environment whose observation/action widths size the model")
    plan.set_defaults(handler=_plan, accepts_overrides=True, overrides=[])


def _split(overrides: list[str]) -> tuple[int, float | None, list[str]]:
    from worldpipe.core.errors import UsageError

    world, budget, rest = None, None, []
    for item in overrides:
        key, _, value = item.partition("=")
        try:
            if key == "world_size":
                world = int(value)
            elif key == "memory_mb":
                budget = float(value)
            else:
                rest.append(item)
        except ValueError:
            raise UsageError(f"argument '{key}': expected a number, got {value!r}") from None
    if world is None or world < 1:
        raise UsageError("argument 'world_size': required, a positive integer (world_size=4)")
    return world, budget, rest


def _measure(model, shapes, obs_dim: int, act_dim: int) -> dict:
    """Activation bytes of one forward and rollout-state bytes of ``observe_context``, per (windows, steps)."""
    import torch

    from worldpipe.parallel.memory import saved_activations

    out = {}
    for rows, steps in sorted(shapes):
        torch.manual_seed(0)
        obs, action = torch.randn(rows, steps, obs_dim), torch.randn(rows, steps, act_dim)
        reward, mask = torch.randn(rows, steps), torch.ones(rows, steps)
        with saved_activations(model) as saved:
            model(obs, action, reward, mask, torch.randn(rows, steps, 1))
        with torch.no_grad():
            state = model.observe_context(obs, action)
        out[(rows, steps)] = (sum(saved.values()), sum(t.numel() * t.element_size() for t in state.values()
                                                        if isinstance(t, torch.Tensor)))
    return out


def layouts_from_conf() -> dict[str, dict]:
    """Every layout of conf/parallel/ by name (the schema defaults are not needed to predict)."""
    from omegaconf import OmegaConf

    folder = PROJECT_ROOT / "conf" / "parallel"
    return {path.stem: {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k != "defaults"}
            for path in sorted(folder.glob("*.yaml"))}


def _plan(args) -> int:
    from worldpipe.config.compose import compose_config
    from worldpipe.data.environments import env_dims
    from worldpipe.models import build_model
    from worldpipe.parallel import planner

    world, budget_mb, overrides = _split(args.overrides)
    cfg = compose_config(overrides)
    dims = env_dims(args.env)
    model = build_model(cfg.model, dims.obs_dim, dims.act_dim)
    layouts = layouts_from_conf()
    measured = _measure(model, planner.shard_shapes(cfg, layouts, world), dims.obs_dim, dims.act_dim)
    ranked = planner.rank(planner.plan(cfg, layouts, world, planner.model_facts(model), measured),
                          None if budget_mb is None else int(budget_mb * 2**20))
    print(json.dumps([planner.as_dict(p) for p in ranked], indent=1) if args.json else planner.table(ranked))
    return 0

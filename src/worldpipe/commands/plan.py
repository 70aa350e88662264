"""`worldpipe plan experiment=... world_size=N [memory_mb=M] [--json]`: predict and rank the parallel layouts.

The world size has the training key's spelling too: ``parallel.nproc_per_node=N`` (times ``parallel.nnodes``, 1 by
default), as ``worldpipe train`` and the pipeline config's ``train.nproc_per_node`` give it.
"""

from __future__ import annotations

import json

import click

from worldpipe.commands import command, overrides
from worldpipe.core.provenance import PROJECT_ROOT


def register(cli: click.Group) -> None:
    cli.add_command(command("plan", _plan, "Predict per-rank memory and communication of every layout in "
                            "conf/parallel/.\n\nOVERRIDES: world_size=N (required; or training's spelling, "
                            "parallel.nproc_per_node=N [parallel.nnodes=K]: N*K ranks), memory_mb=M, and Hydra "
                            "overrides (experiment=...).", [
        click.Option(["--json"], is_flag=True, help="print the predictions as JSON"),
        click.Option(["--env"], default="Pendulum-v1", show_default=True,
                     help="environment whose observation/action widths size the model"),
        overrides()], pass_on=True))


WORLD_KEYS = ("world_size", "parallel.nproc_per_node", "parallel.nnodes")


def _split(overrides: list[str]) -> tuple[int, float | None, list[str]]:
    """(world size, memory budget in MB, the Hydra overrides left) of the command's ``key=value`` arguments."""
    from worldpipe.core.errors import UsageError

    sizes: dict[str, int] = {}
    budget, rest = None, []
    for item in overrides:
        key, _, value = item.partition("=")
        try:
            if key in WORLD_KEYS:
                sizes[key] = int(value)
            elif key == "memory_mb":
                budget = float(value)
            else:
                rest.append(item)
        except ValueError:
            raise UsageError(f"argument '{key}': expected a number, got {value!r}") from None
    world = sizes.get("world_size")
    if "parallel.nproc_per_node" in sizes:  # training's spelling: ranks per node times nodes
        ranks = sizes["parallel.nproc_per_node"] * sizes.get("parallel.nnodes", 1)
        if world is not None and world != ranks:
            raise UsageError(f"argument 'world_size': {world}, but parallel.nproc_per_node x parallel.nnodes is "
                             f"{ranks}: give one of them")
        world = ranks
    if world is None or world < 1:
        raise UsageError("argument 'world_size': required, a positive integer (world_size=4, or training's "
                         "parallel.nproc_per_node=4)")
    return world, budget, rest


def layouts_from_conf(recompute: bool = False) -> dict[str, dict]:
    """Every layout of conf/parallel/ by name (the schema defaults are not needed to predict); with
    ``recompute``, each also as ``NAME+rc`` with ``parallel.recompute=true``."""
    from omegaconf import OmegaConf

    folder = PROJECT_ROOT / "conf" / "parallel"
    layouts = {path.stem: {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k != "defaults"}
               for path in sorted(folder.glob("*.yaml"))}
    if recompute:
        layouts.update({f"{name}+rc": {**layout, "recompute": True} for name, layout in list(layouts.items())})
    return layouts


def _observed_width(model_cfg, state_dim: int) -> int:
    """Width of one observed step: the env's state vector, or a flat frame for a model that learns from pixels
    (drawn at its ``image_size``, which training requires to be the dataset's pixel_size)."""
    from worldpipe.models import observation_key  # imports the model class (torch): only for a plan

    if observation_key(model_cfg) != "pixels":
        return state_dim
    return 3 * int(model_cfg["image_size"]) ** 2


def _plan(args) -> int:
    from worldpipe.config.compose import compose_config
    from worldpipe.data.environments import env_dims
    from worldpipe.models import build_model
    from worldpipe.parallel import forecast
    from worldpipe.parallel.forward_memory import measure_forwards

    world, budget_mb, overrides = _split(args.overrides)
    cfg = compose_config(overrides)
    dims = env_dims(args.env)
    obs_dim = _observed_width(cfg.model, dims.obs_dim)
    model = build_model(cfg.model, obs_dim, dims.act_dim)
    layouts = layouts_from_conf(recompute=getattr(model.parallel, "recompute", False))
    measured = measure_forwards(model, forecast.shard_shapes(cfg, layouts, world), obs_dim, dims.act_dim)
    ranked = forecast.rank(forecast.plan(cfg, layouts, world, forecast.model_facts(model), measured),
                          None if budget_mb is None else int(budget_mb * 2**20))
    print(json.dumps([forecast.as_dict(p) for p in ranked], indent=1) if args.json else forecast.table(ranked))
    return 0

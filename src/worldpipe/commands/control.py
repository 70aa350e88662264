"""`worldpipe control`: a planner acting with a trained model in the real environment (closed-loop evaluation)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from worldpipe.commands import (
    RUN_HELP,
    RUN_TEXT,
    checkpoints_option,
    command,
    group,
    locate,
    pin_recorded_numerics,
    recorded_identity,
    run_argument,
)
from worldpipe.core.atomic import write_text_atomic


def register(cli: click.Group) -> None:
    control = group("control", "plan with a trained model and act in the real environment")
    control.add_command(command("evaluate", _evaluate, "Closed-loop evaluation: the planner acting with the run's "
                                "model on held-out seeds, beside random, the behaviour policy and the planner with "
                                f"the true simulator.\n\n{RUN_TEXT}", [
        run_argument(required=False), checkpoints_option(),
        click.Option(["--env-id"], help="Gymnasium env the model was trained on (default: the one its training "
                                        "data records)"),
        click.Option(["--behaviour-policy"], help="policy that collected the training data (default: the one its "
                                                  "training data records)"),
        *_settings_options(),
        click.Option(["--references"], type=click.Path(exists=True, dir_okay=False),
                     help="JSON of `worldpipe control references` with these settings and the run's seed: its "
                          "random, behaviour and ceiling episodes are taken, not played again"),
        click.Option(["--out"], required=True, help="metrics JSON to write"),
        click.Option(["--plot"], help="returns bar chart (PNG) to write"),
        click.Option(["--loop-plot"], help="control-loop split (PNG) to write"),
        click.Option(["--pictures"], help="folder for a pixel model's episode GIF (true beside imagined frames)"),
        click.Option(["--tracking-uri"], help="MLflow to log to (default: the run's recorded URI)"),
        click.Option(["--no-tracking"], is_flag=True, help="do not log to MLflow"),
    ]))
    control.add_command(command("references", _references, "The contenders that do not use a model (random "
                                "actions, the behaviour policy, the planner with the true simulator) on the held-out "
                                "seeds of runs with seed RUN_SEED: one JSON that `control evaluate --references` "
                                "takes for every run with the same settings and seed.", [
        click.Option(["--env-id"], required=True, help="Gymnasium env"),
        click.Option(["--behaviour-policy"], required=True, help="policy that collected the training data"),
        *_env_options(),
        click.Option(["--run-seed"], type=int, required=True, help="the evaluated runs' `seed`"),
        *_settings_options(),
        click.Option(["--out"], required=True, help="references JSON to write"),
    ]))
    control.add_command(command("rerun", _rerun, "Repeat a recorded closed-loop evaluation from its metrics JSON "
                                "and compare bit for bit (exit 1 on any difference).\n\nRECORD: the metrics JSON of "
                                f"`worldpipe control evaluate`. RUN: the evaluated run, {RUN_HELP} (the step is the "
                                "record's; a step folder must be that one).", [
        click.Argument(["record"]), run_argument(required=False), checkpoints_option(),
        click.Option(["--out"], help="write the repeated evaluation's JSON here"),
    ]))
    control.add_command(command("yardstick", _yardstick, "Measure the ceiling's return against its budget: the "
                                "planner with the true simulator on the held-out seeds, doubling samples and "
                                "iterations from the planner's own, and the budget where doubling stops raising the "
                                "return (what `control: ceiling_overrides` records).", [
        click.Option(["--env-id"], default="Pendulum-v1", show_default=True, help="Gymnasium env"),
        click.Option(["--max-steps"], type=int, default=200, show_default=True, help="steps per episode"),
        click.Option(["--episodes"], type=int, default=20, show_default=True, help="held-out seeds"),
        click.Option(["--seed"], type=int, default=5000, show_default=True, help="root of the held-out episode seeds"),
        click.Option(["--planner"], default="mppi", show_default=True, help="conf/planner/<name>.yaml"),
        click.Option(["--set", "planner_overrides"], multiple=True, metavar="KEY=VALUE",
                     help="planner setting (repeatable): the curve's first level"),
        click.Option(["--levels"], type=click.IntRange(2, 8), default=5, show_default=True,
                     help="budget levels, each doubling samples and iterations"),
        *_env_options(),
        click.Option(["--out"], required=True, help="curve JSON to write"),
        click.Option(["--plot"], help="curve PNG to write"),
    ]))
    cli.add_command(control)


def _env_options() -> list[click.Option]:
    """How the env is made beyond its id, as the training data's spec makes it (`control references`, `yardstick`)."""
    return [
        click.Option(["--action-repeat"], type=click.IntRange(min=1), default=1, show_default=True,
                     help="control steps each action is held for (the training data's spec)"),
        click.Option(["--observation-keys"], help="comma-separated order a dict observation is flattened in (the "
                                                  "training data's spec)"),
    ]


def _observation_keys(args) -> list[str] | None:
    return [key for key in (args.observation_keys or "").split(",") if key] or None


def _settings_options() -> list[click.Option]:
    """The closed-loop settings `control evaluate` and `control references` share (one home for both)."""
    return [
        click.Option(["--max-steps"], type=int, default=200, show_default=True, help="steps per episode"),
        click.Option(["--episodes"], type=int, default=20, show_default=True, help="held-out seeds"),
        click.Option(["--seed"], type=int, default=5000, show_default=True,
                     help="root of the held-out episode seeds (no dataset's seed)"),
        click.Option(["--context"], type=int, default=8, show_default=True, help="observed steps the model filters"),
        click.Option(["--planner"], default="mppi", show_default=True, help="conf/planner/<name>.yaml"),
        click.Option(["--set", "planner_overrides"], multiple=True, metavar="KEY=VALUE",
                     help="planner setting (repeatable), e.g. --set horizon=20"),
        click.Option(["--ceiling-set", "ceiling_overrides"], multiple=True, metavar="KEY=VALUE",
                     help="the ceiling's planner setting over the planner's (repeatable): its budget, measured by "
                          "`worldpipe control yardstick`, e.g. --ceiling-set samples=512"),
        click.Option(["--http-episodes"], type=int, default=0, show_default=True,
                     help="episodes the planner also plays with the model behind `worldpipe serve` (over HTTP): "
                          "a latency probe of the loop, not a score"),
        click.Option(["--value"], metavar="JSON",
                     help="the planner's terminal value, fitted through the run's model on its training data: value "
                          "settings as a JSON object, e.g. '{\"iterations\": 6}' (the rest default)"),
    ]


def _value(args) -> dict | None:
    """``--value`` with every setting written out; one line naming the option where it is not a settings object."""
    from worldpipe.config.value import value_settings
    from worldpipe.control.checks import ControlSettingsError

    if args.value is None:
        return None
    try:
        return value_settings(json.loads(args.value), "--value")
    except ValueError as err:  # json.JSONDecodeError is one
        raise ControlSettingsError(f"--value {args.value!r}: {err}") from None


def _planners(args) -> tuple[dict, dict]:
    """The planner's config and the ceiling's (the same planner at its own budget; empty where none is set)."""
    from worldpipe.config.paths import conf_dir
    from worldpipe.config.planner import planner_config

    planner = planner_config(args.planner, list(args.planner_overrides), conf_dir())
    ceiling = (planner_config(args.planner, [*args.planner_overrides, *args.ceiling_overrides], conf_dir())
               if args.ceiling_overrides else {})
    return planner, ceiling


def _references(args) -> int:
    from worldpipe.control.checks import check_counts, check_env
    from worldpipe.control.evaluation import ControlSettings, evaluate_references

    check_counts(args.max_steps, args.episodes, args.context, args.http_episodes)
    check_env(args.env_id, args.behaviour_policy, {})  # no model here: the env, its true simulator and the policy
    planner, ceiling = _planners(args)
    settings = ControlSettings(args.env_id, args.behaviour_policy, args.max_steps, args.episodes, args.seed,
                               args.context, planner, args.http_episodes, ceiling, args.action_repeat,
                               _observation_keys(args), _value(args))
    references = evaluate_references(settings, args.run_seed)
    write_text_atomic(Path(args.out), json.dumps(references, indent=1))
    for name, contender in references["contenders"].items():
        print(f"{name:>10}: {len(contender['returns'])} episodes, mean return "
              f"{sum(contender['returns']) / len(contender['returns']):.1f}")
    return 0


def _evaluate(args) -> int:
    where = locate(args)
    pin_recorded_numerics(where)  # the evaluated run's code paths, before torch computes
    from worldpipe.control.checks import (
        ControlSettingsError,
        check_counts,
        check_env,
        recorded_env,
        settled_env,
    )
    from worldpipe.control.dynamics import ControlError
    from worldpipe.control.evaluation import ControlSettings, check_references, evaluate_control

    # Refused before any episode runs, cheapest first (each one line naming the option, exit 2).
    check_counts(args.max_steps, args.episodes, args.context, args.http_episodes)
    planner, ceiling = _planners(args)
    identity = recorded_identity(where)
    recorded = recorded_env(identity)
    env_id, policy = settled_env(args.env_id, args.behaviour_policy, recorded)
    check_env(env_id, policy, identity)
    # The env as the training data's spec made it (action repeat, observation key order), where it is recorded.
    options = (recorded.env_options or {}) if env_id == recorded.env_id else {}
    settings = ControlSettings(env_id, policy, args.max_steps, args.episodes, args.seed, args.context, planner,
                               args.http_episodes, ceiling, **options, value=_value(args))
    gif = None if not args.pictures else str(Path(args.pictures) / "planner-episode-0.gif")
    if args.pictures:
        Path(args.pictures).mkdir(parents=True, exist_ok=True)  # the rule's folder, empty for a state model
    references = None
    if args.references:
        try:
            references = json.loads(Path(args.references).read_text())
            check_references(references, settings, int((identity.get("config") or {}).get("seed", 0)))
        except (ValueError, AttributeError, ControlError) as err:
            raise ControlSettingsError(f"--references {args.references}: {err}") from None
    result = evaluate_control(where.root, settings, step=where.step, gif=gif, references=references)
    _write(result, args.out, args.plot, args.loop_plot)
    _print_summary(result)
    if args.no_tracking:
        return 0
    return _track(result, args, where.root)


def _write(result: dict, out: str, plot: str | None, loop_plot: str | None) -> None:
    from worldpipe.control.report import plot_control_loop, plot_returns

    write_text_atomic(Path(out), json.dumps(result, indent=1))
    if plot:
        plot_returns(result, plot)
    if loop_plot:
        plot_control_loop(result, loop_plot)


def _print_summary(result: dict) -> None:
    for name, c in result["contenders"].items():
        low, high = c["ci95"]
        score = "" if c["score"] is None else f"  score {c['score']:.3f}"
        print(f"{name:>10}: return {c['mean']:9.1f}  95% CI [{low:.1f}, {high:.1f}]{score}")
    yardstick = result.get("yardstick") or {}
    budget = yardstick.get("ceiling_budget") or {}
    if budget:
        print(f"score: (R - R_random) / (R_ceiling - R_random); ceiling: {budget.get('samples')} samples x "
              f"{budget.get('iterations')} iterations, horizon {budget.get('horizon')}, with the true simulator")
    if yardstick.get("no_score_reason"):
        print(yardstick["no_score_reason"])
    known = yardstick.get("best_known")
    if known is not None:
        known_score = "" if known.get("score") is None else f", score {known['score']:.3f} on this scale"
        print(f"best known return of {result['settings']['env_id']}: {known['return']:g}{known_score} "
              f"({known['source']})")
    loops = {"planner": result["contenders"]["planner"]["control_loop"]}
    if "http_probe" in result:
        loops["planner over HTTP"] = result["http_probe"]["control_loop"]
    for name, loop in loops.items():
        period = "" if loop["period_ms"] is None else f" of a {loop['period_ms']:g} ms control period"
        transport = loop["parts"]["transport"]
        wire = "" if name == "planner" else (f" (transport p50 {transport['p50_ms']:.2f} ms, "
                                              f"p99 {transport['p99_ms']:.2f} ms)")
        print(f"{name} decision p50 {loop['decision_p50_ms']:.1f} ms, p99 {loop['decision_p99_ms']:.1f} ms{period}"
              f"{wire}")
    if "http_probe" in result:
        probe = result["http_probe"]
        episodes = f"{probe['episodes']} episode{'s' if probe['episodes'] != 1 else ''}"
        print(f"over HTTP (a latency probe, {episodes}) the planner takes the in-process actions: "
              f"{result['http_takes_the_in_process_actions']}")


def _track(result: dict, args, root: str) -> int:
    from worldpipe.control.record import record_control

    try:
        where = record_control(result, root, args.tracking_uri,
                               [p for p in (args.out, args.plot, args.loop_plot, *result.get("pictures", [])) if p])
    except Exception as err:  # noqa: BLE001 - any MLflow failure: one line, the files are written
        print(f"error: logging the control evaluation to MLflow failed ({type(err).__name__}: {err}); {args.out} "
              "is written; run the same command again to log it", file=sys.stderr)
        return 1
    if where:
        print(f"logged to MLflow run {where}")
    return 0


def _yardstick(args) -> int:
    from worldpipe.config.paths import conf_dir
    from worldpipe.config.planner import planner_config
    from worldpipe.control.dynamics import TRUE_SIMULATORS
    from worldpipe.control.yardstick import budget_curve, plot_budget_curve
    from worldpipe.core.errors import UsageError

    if args.env_id not in TRUE_SIMULATORS:
        raise UsageError(f"control yardstick --env-id {args.env_id}: the ceiling needs the env's true simulator, "
                         f"which the project has for {', '.join(TRUE_SIMULATORS)} only")
    if args.episodes < 2 or args.max_steps < 1:
        raise UsageError("control yardstick: --episodes must be >= 2 (a confidence interval) and --max-steps >= 1")
    planner = planner_config(args.planner, list(args.planner_overrides), conf_dir())

    def progress(point: dict) -> None:
        low, high = point["ci95"]
        gain = point.get("gain_over_previous")
        more = "" if gain is None else (f"  gain over the previous level {gain['mean']:+.1f} "
                                        f"[{gain['ci95'][0]:+.1f}, {gain['ci95'][1]:+.1f}]")
        print(f"{point['samples']:>6} samples x {point['iterations']:>3} iterations: return {point['mean']:8.1f}  "
              f"95% CI [{low:.1f}, {high:.1f}]{more}", flush=True)

    env_options = {"action_repeat": args.action_repeat, "observation_keys": _observation_keys(args)}
    curve = budget_curve(args.env_id, planner, args.episodes, args.max_steps, args.seed, args.levels, progress,
                         env_options)
    write_text_atomic(Path(args.out), json.dumps(curve, indent=1))
    if args.plot:
        plot_budget_curve(curve, args.plot)
    chosen = curve["levels"][curve["chosen_level"]]
    print(f"ceiling: {chosen['samples']} samples x {chosen['iterations']} iterations, return {chosen['mean']:.1f} "
          f"(random {curve['random']['mean']:.1f}); in the pipeline config: "
          f"control: {{ceiling_overrides: [{', '.join(curve['ceiling_overrides'])}]}}")
    known = curve["best_known"]
    if known is not None:
        print(f"best known return of {args.env_id}: {known['return']:g} ({known['source']})")
    return 0


def _rerun(args) -> int:
    from worldpipe.core.errors import UsageError

    try:
        record = json.loads(Path(args.record).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{args.record}: not a readable control evaluation record ({err}); give the metrics JSON "
                         "that `worldpipe control evaluate --out` wrote") from None
    try:
        step = int(record["checkpoint_step"])
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{args.record}: no checkpoint_step (not a control evaluation record); give the metrics "
                         "JSON that `worldpipe control evaluate --out` wrote") from None
    where = locate(args, step)  # the recorded step; a step folder must be that one
    pin_recorded_numerics(where)
    from worldpipe.control.evaluation import rerun_control

    result, differences = rerun_control(where.root, record)
    if args.out:
        write_text_atomic(Path(args.out), json.dumps(result, indent=1))
    if differences:
        for line in differences:
            print(f"differs: {line}")
        return 1
    print(f"bit-identical: {len(result['contenders'])} contenders x {record['settings']['episodes']} episodes, "
          "same actions and returns")
    return 0

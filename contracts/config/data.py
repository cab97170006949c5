"""`data`: the training and evaluation prompts, how their rows are read and encoded, and the
generators that write them where they are missing (`synth`, `gym`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from contracts.config.base import PositiveInt, Section
from contracts.config.gym import GymDataSpec
from contracts.data import DAPO_PROMPT_TEMPLATE, ColumnMap, parse_hub_id

SynthTemplate = Literal["short", "dapo", "one-shot", "one-shot-python", "few-shot"]
"""How the synthetic task puts a problem to the model (services/demo/synthetic.py `TEMPLATES`)."""


class SynthDataSpec(Section):
    """A synthetic arithmetic task in the DAPO-Math-17K schema (`dapo data synth`)."""

    num_train: PositiveInt = 20000
    num_eval: PositiveInt = 128
    difficulty: Annotated[int, Field(ge=0, le=8)] = 1
    template: SynthTemplate = "short"
    """`dapo` wraps problems in the DAPO-Math-17K prompt text; `short` keeps tiny models fast;
    `one-shot` shows a chat model one worked example first, `one-shot-python` one that runs
    Python with the `python` tool (`rollout.tools`) (services/demo/synthetic.py)."""
    tool_traces: float = Field(0.0, ge=0, le=1)
    """The share of training rows whose `solution` calls the calculator (level 7, the tool-use
    demo): what the tiny base learns the call format from."""


class DataConfig(Section):
    train_path: str
    """Training prompts: a .parquet, .jsonl or .json file, a directory written by `datasets`
    `save_to_disk`, or a Hugging Face Hub dataset `hf://OWNER/NAME[?split=SPLIT&name=CONFIG]`
    (split defaults to train; these two need the `data` extra). Rows in the verl /
    DAPO-Math-17K format or with flat columns (docs/data.md). The presets read
    data/dapo-math-17k.parquet, which `dapo data fetch dapo-math-17k` writes."""
    eval_path: str | None = None
    """Eval set, from any source `train_path` takes (paper: AIME 2024, 30 problems; `dapo data
    fetch aime-2024`). Duplicate rows are merged. None disables evaluation."""
    prompt_key: str | None = None
    """Column holding the prompt: chat messages (verl format) or plain text (one user message).
    None = per row, the first of `prompt`, `problem`, `question` it has. Applies to both sets."""
    answer_key: str | None = None
    """Column holding the verifier's ground truth; a dotted path reads inside an object column.
    None = per row, `reward_model.ground_truth`, then `answer`. A GSM8K-style answer (a worked
    solution whose last line is `#### 42`) yields `42`. Applies to both sets."""
    extra_keys: tuple[str, ...] = ()
    """Columns copied into each prompt's `extra_info` (e.g. `level`); every row must have them."""
    prompt_template: str | None = None
    """Wraps plain-text prompts so the policy is told the answer format: `{problem}` is replaced
    by the text; `dapo` = DAPO-Math-17K's instruction, whose `Answer:` line the `dapo` verifier
    reads. Chat-message prompts are never wrapped. None = the text alone."""
    synth: SynthDataSpec | None = None
    """If set, missing train/eval files are generated with this spec: held out by construction,
    the evaluation file shares no fact (operand multiset) with the training file."""
    gym: GymDataSpec | None = None
    """If set, the train/eval files are generated from reasoning-gym tasks (one, or a weighted
    mixture; `contracts.config.gym`): written where missing or made from another spec, each row's
    `data_source` its task's name and its `extra_info` what the task's own scorer needs, which
    then scores it (in the sandbox). The evaluation file holds `num_eval` problems per task, none
    of whose questions occurs in training. Needs `pip install 'dapo-services[gym]'`."""
    heldout_key: str | None = None
    """What makes an evaluation problem "seen in training" (the held-out check at start): None =
    the same prompt; else an `extra_info` field (listed in `extra_keys`) naming what a model could
    memorise, e.g. a problem id or the underlying fact. Evaluation problems a training row shares
    are counted and logged at start, and the run's figure is labelled in-distribution."""
    drop_eval_overlap: bool = False
    """Leave the evaluation problems the training set shares out of the evaluation set, so what
    is left is held out."""
    prompt_format: Literal["chat", "completion"] = "chat"
    """chat: the prompt's messages go through the tokenizer's chat template (paper). completion:
    the text as it is, no template, for a model used as a completer (few-shot examples, then the
    question; pair it with `rollout.stop`, e.g. a newline, so generation ends with the answer).
    Training, the evaluation rounds, `dapo run --in-process` and `dapo eval` all encode alike."""
    max_prompt_len: PositiveInt = 2048
    """Prompt tokens; longer prompts are left-truncated (paper: 2048)."""
    shuffle: bool = True
    seed: int = 0

    @field_validator("train_path", "eval_path")
    @classmethod
    def _check_source(cls, value: str | None) -> str | None:
        if value is not None:
            parse_hub_id(value)  # a malformed hf:// id fails here, not in the learner
        return value

    @model_validator(mode="after")
    def _one_generator(self) -> DataConfig:
        if self.synth is not None and self.gym is not None:
            raise ValueError("data.synth and data.gym both generate the data files: set one")
        return self

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, value: str | None) -> str | None:
        if value is not None and value != "dapo" and "{problem}" not in value:
            raise ValueError("must contain '{problem}' (where the text goes) or be 'dapo'")
        return value

    @field_validator("prompt_key", "answer_key", "extra_keys")
    @classmethod
    def _check_keys(cls, value: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        keys = (value,) if isinstance(value, str) else value or ()
        ColumnMap(extra_keys=keys)  # rejects an empty key or an empty dotted part
        return value

    @property
    def chat(self) -> bool:
        """Whether prompts go through the chat template (`prompt_format`)."""
        return self.prompt_format == "chat"

    @property
    def columns(self) -> ColumnMap:
        """The column mapping `contracts.data` reads both sets with."""
        template = DAPO_PROMPT_TEMPLATE if self.prompt_template == "dapo" else self.prompt_template
        return ColumnMap(
            prompt_key=self.prompt_key,
            answer_key=self.answer_key,
            extra_keys=self.extra_keys,
            prompt_template=template,
        )

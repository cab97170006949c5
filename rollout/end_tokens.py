"""The token ids that end a response, shared by every generation engine."""

from __future__ import annotations


def end_token_ids(model_dir: str, tokenizer_eos: int | None) -> list[int]:
    """Every token id that ends a response: the tokenizer's eos, then each id of
    `generation_config.json`'s `eos_token_id` (an int or a list).

    Instruct models list their end-of-turn token there besides the tokenizer's eos
    (Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`; Llama-3-Instruct: `<|eot_id|>` and
    `<|end_of_text|>`); an engine that stopped at the tokenizer's eos alone would generate past the
    end of the answer until `max_response_len`, and score and train on that text. A model directory
    without a generation config (or one that names no eos) ends at the tokenizer's eos only.
    """
    from transformers import GenerationConfig

    try:
        listed = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is the only end token
        listed = None
    ids = [tokenizer_eos] if tokenizer_eos is not None else []
    ids += [listed] if isinstance(listed, int) else list(listed or [])
    ends = list(dict.fromkeys(int(i) for i in ids))  # in order, without repeats
    if not ends:
        raise ValueError(
            f"{model_dir}: neither the tokenizer nor generation_config.json names an end token"
        )
    return ends

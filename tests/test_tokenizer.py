"""The tokenizer a policy renders prompts with."""

from __future__ import annotations

import logging

from tests.conftest import require_smollm2


def test_a_bpe_tokenizer_decodes_as_before_without_the_clean_up_warning(caplog):
    """SmolLM2's (BPE) tokenizer: transformers skips the space clean-up for BPE and warns
    that it does; loaded here, the text is the same and nothing is said."""
    require_smollm2()
    from transformers.utils import logging as hf_logging

    from qerl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    text = "Natalia sold 48 clips , then half as many . How many ?"
    ids = tokenizer(text).input_ids
    hf_logging.enable_propagation()  # transformers' records reach caplog
    try:
        with caplog.at_level(logging.WARNING):
            decoded = tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        hf_logging.disable_propagation()
    assert decoded == tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)
    assert " ," in decoded  # the spaces a clean-up would have stripped
    assert not [r for r in caplog.records if "clean_up_tokenization_spaces" in r.getMessage()]

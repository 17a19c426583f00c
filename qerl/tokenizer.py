"""The tokenizer that renders prompts for a policy: the one its model came with (written
next to the run's outputs) or one named explicitly, with a chat template."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from qerl.errors import QerlError


class TokenizerError(QerlError):
    """No usable tokenizer for the model."""


def load_tokenizer(source: str | Path):
    """A tokenizer from a directory, a hub id, a ``.gguf`` file or a packaged GGUF name."""
    from qerl.sources import gguf_path

    gguf = gguf_path(str(source))
    if gguf is not None:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        # transformers skips the space clean-up for BPE anyway (it would strip real spaces)
        # and warns once a run that it does: say so up front instead.
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def policy_tokenizer(policy, directory: Path, source: str | None = None, cpu: bool = False):
    """``source`` (see ``load_tokenizer``) if given, else the policy's own tokenizer files
    written to ``directory`` (by one process when several run). Needs a chat template:
    prompts are conversations. The pad token falls back to EOS."""
    from accelerate import PartialState

    if source is None and policy.save_extras is None:
        raise TokenizerError("the model has no tokenizer (random weights): name one "
                             "(tokenizer: in a training config, --tokenizer for qerl eval)")
    state = PartialState(cpu=cpu)
    with state.main_process_first():  # one process writes, the others read after it
        if source is None:
            if state.is_main_process:
                directory.mkdir(parents=True, exist_ok=True)
                policy.save_extras(directory)
            source = directory
        tokenizer = load_tokenizer(source)
    if not tokenizer.chat_template:
        raise TokenizerError(f"the tokenizer from {source} has no chat template; prompts are "
                             "conversations: use an instruct model's tokenizer")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# The stand-in's chat template: messages' contents, then one token to answer after.
STAND_IN_CHAT = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w1{% endif %}")


def stand_in_tokenizer(chat: bool = True):
    """A word-level tokenizer over 128 symbols (w0..w123, <unk>, <s>, </s>, <pad>), for
    models with random weights: benchmarks render prompts with it, and their speed does not
    depend on what the tokens say. ``chat`` adds a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(124)} | {"<unk>": 124, "<s>": 125, "</s>": 126,
                                                 "<pad>": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat:
        tokenizer.chat_template = STAND_IN_CHAT
    return tokenizer

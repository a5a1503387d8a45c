"""The index variants ``scripts/make_index_variants.py`` writes for a GPU A/B: each still applies to the index as it
is now, and computes the same estimate (the A/B's "same listing" is then a check, not a hope)."""
import importlib.util
from pathlib import Path

import pytest
import torch

from minference_fx.kernels.index import vs_estimate

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


variants = _load("make_index_variants", SCRIPTS / "make_index_variants.py")


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_each_variant_applies_and_gives_the_shipped_estimate(name, tmp_path):
    (path,) = variants.write_variants([name], tmp_path)
    assert path.read_text() != variants.SOURCE.read_text()
    variant = _load(f"index_{name}", path)
    torch.manual_seed(0)
    # 150 keys, three key blocks: the two-blocks-a-program variant's last program holds one block and skips one
    q = torch.randn(1, 4, 130, 32, dtype=torch.float16)
    k = torch.randn(1, 2, 150, 32, dtype=torch.float16)
    shipped = vs_estimate(q, k, scale=0.18, q_offset=20)
    tried = variant.vs_estimate(q, k, scale=0.18, q_offset=20)
    for a, b in zip(shipped, tried):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_an_index_the_substitutions_no_longer_match_is_refused():
    with pytest.raises(SystemExit, match="not found exactly once"):
        variants.VARIANTS["rs64"]("def unrelated(): pass\n")

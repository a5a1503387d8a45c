"""The attention-mass measurement behind the random-weight benchmark's bound (minference_fx.tools.attention_mass,
run by scripts/explore_attention_mass.py)."""
import math

import torch

from minference_fx.tools.attention_mass import mass_profile


def test_uniform_rows_need_their_share_of_keys():
    # q = 0: every causal key of a row gets the same weight, so K keys hold K / row and 90 % needs ceil(0.9 row)
    s, rows, keys = 64, 4, 16
    q, k = torch.zeros(1, 2, s, 8), torch.randn(1, 1, s, 8)
    profile = mass_profile(q, k, scale=1.0, rows=rows, keys=keys)
    lengths = torch.arange(s - rows, s, dtype=torch.float64) + 1
    top = (keys / lengths).mean()
    need90 = torch.tensor([math.ceil(0.9 * n - 1e-9) / n for n in lengths.tolist()]).mean()
    torch.testing.assert_close(profile["top"], torch.full((2,), top.item()), atol=1e-5, rtol=0)
    torch.testing.assert_close(profile["need90"], torch.full((2,), need90.item()), atol=1e-5, rtol=0)


def test_one_heavy_key_holds_the_mass_and_gqa_heads_read_their_kv_head():
    # key 3 of kv head 0 and key 5 of kv head 1 outscore the rest by far; query heads 0-1 read kv head 0, 2-3 kv head 1
    s, d = 32, 4
    k = torch.zeros(1, 2, s, d)
    k[0, 0, 3, 0] = 1.0
    k[0, 1, 5, 1] = 1.0
    q = torch.zeros(1, 4, s, d)
    q[0, :2, :, 0] = 60.0
    q[0, 2:, :, 1] = 60.0
    profile = mass_profile(q, k, scale=1.0, rows=8, keys=1)
    assert torch.all(profile["top"] > 0.999)
    lengths = torch.arange(s - 8, s, dtype=torch.float64) + 1
    torch.testing.assert_close(profile["need95"], torch.full((4,), (1 / lengths).mean().item()), atol=1e-6, rtol=0)
    # a wrong GQA mapping (say h % kv_heads) would hand query head 1 kv head 1, where its key is no heavier
    # than any other, and the first assertion would fail

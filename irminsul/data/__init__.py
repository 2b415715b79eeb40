"""The real, public data the project reads: agent traces, tool schemas, multi-document QA and a
tokenizer, shipped inside the package with their licences (see ATTRIBUTION.md in this folder).

Workload builders, the evaluations, the reference-model trainer, the tests and the benchmarks all
find it here; a `--data DIR` option points them at another folder with the same layout.
"""

from pathlib import Path

from irminsul.errors import UserFacingError

DATA_DIR = Path(__file__).resolve().parent


def data_dir(override: str | Path | None = None) -> Path:
    """The data folder: `override` (a `--data` option) if given, else the one shipped here."""
    path = Path(override) if override else DATA_DIR
    if not path.is_dir():
        raise UserFacingError(
            f"the data folder {path} does not exist; pass --data with a folder laid out like {DATA_DIR}"
        )
    return path


def data_file(*parts: str, root: str | Path | None = None) -> Path:
    """A file of the data folder; a one-line error naming it if it is missing."""
    path = data_dir(root).joinpath(*parts)
    if not path.exists():
        raise UserFacingError(
            f"missing data file {path}: the installation is incomplete (reinstall "
            f"irminsul) or --data points at a folder without it"
        )
    return path

"""Reading the project's YAML files (cost files, graphs, candidates, recipes) with one-line errors."""

from __future__ import annotations

from typing import Any


def read_yaml(path: str, what: str) -> Any:
    """Parsed content of ``path``; a missing file or bad YAML is one ``ValueError`` naming ``what`` and ``path``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not text (expected YAML)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{what} {path} is not valid YAML: {str(e).splitlines()[0]}") from None

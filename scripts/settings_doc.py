"""Write docs/settings.md's settings table from the settings' own Field descriptions (utils/config/settings.py), so the
help is written once: `python scripts/settings_doc.py`. tests/test_settings.py fails while the committed table
differs from what this writes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.config.settings import FIELDS, env_name, flag_name  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
BEGIN = "<!-- settings table: written by scripts/settings_doc.py from utils/config/settings.py's descriptions -->"
END = "<!-- end of the settings table -->"
# Not a setting: read only from the environment, never a flag (utils/common/hub_token.py).
TOKEN_ROW = "| `HF_TOKEN` or `HF_TOKEN_PATH` | none (env only) | unset | the Hub token, or a mounted file holding it |"


def shown_default(field) -> str:
    if field.default_factory is not None:
        return "see why"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def settings_table() -> str:
    rows = ["| env | flag | default | why |", "| --- | --- | --- | --- |"]
    for name, field in FIELDS.items():
        flag = "--config" if name == "config_file" else flag_name(name)  # --config-file works too, unlisted
        why = field.description.replace("|", "\\|")
        rows.append(f"| `{env_name(name)}` | `{flag}` | {shown_default(field)} | {why} |")
    return "\n".join([BEGIN, *rows, TOKEN_ROW, END])


def with_table(doc: str) -> str:
    """docs/settings.md with the table between its markers written anew."""
    head, found, rest = doc.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"{DOC} lacks the markers {BEGIN} ... {END}; put them where the table goes")
    return head + settings_table() + rest.partition(END)[2]


if __name__ == "__main__":
    DOC.write_text(with_table(DOC.read_text()))

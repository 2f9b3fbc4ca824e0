"""`inf2serve compile --chat-template FILE`: the template is part of what the artifact's key covers, and
a missing file is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import ConfigError
from compile.pipeline import with_chat_template


def test_another_template_is_another_source(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jinja", tmp_path / "b.jinja"
    first.write_text("{{ messages }}")
    second.write_text("{{ tools }}{{ messages }}")
    plain = "0" * 64
    assert with_chat_template(plain, None) == plain
    assert len({plain, with_chat_template(plain, first), with_chat_template(plain, second)}) == 3


def test_a_missing_template_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the chat template"):
        with_chat_template("0" * 64, tmp_path / "missing.jinja")

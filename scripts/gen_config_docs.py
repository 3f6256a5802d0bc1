"""Regenerate docs/configuration.md from the config schema: `python scripts/gen_config_docs.py`."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdptrain.config.docs import render_configuration_md  # noqa: E402

if __name__ == "__main__":
    (ROOT / "docs" / "configuration.md").write_text(render_configuration_md())
    print("wrote docs/configuration.md")

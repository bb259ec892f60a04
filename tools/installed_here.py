"""Exit 0 when the installed `lmcli` distribution is an editable install of this checkout."""
import json
import sys
from importlib import metadata
from pathlib import Path

try:
    url = json.loads(metadata.distribution("lmcli").read_text("direct_url.json") or "{}").get("url", "")
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if url == Path(__file__).resolve().parent.parent.as_uri() else 1)

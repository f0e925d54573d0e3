"""Whether a checkpoint's sentence-transformers modules describe the embeddings kvscope
answers (the last token's hidden state, normalized): `sentence_transformers_pooling`
reads `modules.json` and its pooling config and says why not, if they differ.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The sentence-transformers modules kvscope's embeddings agree with: the model, last-
#: token pooling, normalization.
AGREEING_MODULES = ("Transformer", "Pooling", "Normalize")


def sentence_transformers_pooling(directory: Path) -> str | None:
    """Why the embeddings the checkpoint's sentence-transformers modules (`modules.json`)
    describe are not the last token's hidden state, normalized; None if they are, or if
    it has no such modules."""
    path = directory / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
        kinds = [str(module["type"]).rsplit(".", 1)[-1] for module in modules]
        other = [kind for kind in kinds if kind not in AGREEING_MODULES]
        if other:
            return f"its sentence-transformers modules include {other[0]}"
        pooling = next((m for m in modules if str(m["type"]).endswith(".Pooling")), None)
        if pooling is None:
            return None
        config = json.loads((directory / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its sentence-transformers modules cannot be read ({exc!r})"
    modes = sorted(
        k.removeprefix("pooling_mode_")
        for k, v in config.items()
        if k.startswith("pooling_mode_") and v
    )
    if modes != ["lasttoken"]:
        return f"it pools by {' and '.join(modes) or 'nothing'} (its {pooling['path']}/config.json)"
    return None

"""`zerotrain port`: a DeepSpeed program's imports and launcher lines rewritten to zerotrain.

- `paths`: DeepSpeed's import paths and where each is in zerotrain (mirrored `zerotrain.X` paths, moved
  names, and the paths without a counterpart with what to write instead); docs/porting.md's table.
- `rewrite`: the source-text rewriting of Python files (tokenize) and shell scripts.
- `command`: the command (`zerotrain port PATH... [--write]`).
"""
from .paths import mirrored_paths, porting_table
from .rewrite import Unported, rewrite_python, rewrite_shell

__all__ = ["mirrored_paths", "porting_table", "Unported", "rewrite_python", "rewrite_shell"]

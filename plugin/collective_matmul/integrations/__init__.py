"""Adapters for frameworks whose layers take no `dot_general` argument.

Each adapter lives in its own subpackage, imports its framework only when
installed, guards the framework version and the private names it patches,
and is tested against the real framework (`tests/integrations/`).
"""

"""Plans and calibrations for the trainers people already run (verl, OpenRLHF).

Torch-free: the exports write settings, the log readers read JSON lines and text; nothing of
the trainers is imported.
"""

from __future__ import annotations

#: The trainer releases whose configuration keys and flags the exports are checked against
#: (tests/peers.py downloads exactly these wheels). The one place these versions are named.
CHECKED_VERSIONS = {"verl": "0.9.1", "openrlhf": "0.11.2"}

"""Golden models and golden token locks (fp32 teacher-forcing anchors, near-tie bands, tripwires).

Empty until the golden-lock work lands; see golden/README.md.
"""

__all__: list[str] = []

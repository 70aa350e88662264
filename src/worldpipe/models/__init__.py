"""World models."""

from worldpipe.models.rssm import RSSM, RSSMConfig

__all__ = ["RSSM", "RSSMConfig"]

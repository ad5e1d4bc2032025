"""The one exception type shardwise raises for misuse, so callers can catch it apart from torch's."""


class ShardwiseError(RuntimeError):
    """A misuse of shardwise, or ranks that disagree. The message names the parameter, unit or file at fault."""

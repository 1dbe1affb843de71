"""The configuration error: every problem found, one line each, raised once."""


class ConfigError(ValueError):
    """Invalid configuration. ``problems`` holds one line per problem naming key, value, rule."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

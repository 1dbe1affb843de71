"""The trainer step's own failure: the step is not trained, and says why."""


class StepError(RuntimeError):
    pass

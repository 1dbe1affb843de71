"""The trainer step's own failure: the step is not trained, and says why."""


class StepError(RuntimeError):
    pass


class PauseLost(StepError):
    """The gateway pause was lost (it could not be extended in time, or was taken over)
    before the step touched any weight: the step can be taken up again under a new pause."""

"""A planted pickle for the safe-loading tests: unpickling a ``Planted`` calls
``Planted(path)``, whose constructor writes ``path``. A file carrying one is what a malicious
checkpoint looks like; loading it must be refused before that call."""


class Planted:
    def __init__(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("the planted code ran")
        self.path = path

    def __reduce__(self):
        return (Planted, (self.path,))

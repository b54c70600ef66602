"""Print op, print.pb encoder/writer in MindSpore's wire format, parse_print (see the Print issue)."""

__all__: list[str] = []

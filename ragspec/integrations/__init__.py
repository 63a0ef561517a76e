"""Integrations of the ragspec engine (installed as ``ragspec.integrations``).

* :mod:`.langchain` - ``RagspecLLM`` and ``ChatRagspec`` (LangChain), ``with_documents``.
* :mod:`.server` - ``create_app()``: the FastAPI REST service (OpenAI-compatible
  completions and chat, ``/v1/summarize``, ``/metrics``, ``/health``).
* :mod:`.cli` - ``ragspec serve``.
* :mod:`.settings`, :mod:`.schemas`, :mod:`.scheduler`, :mod:`.metrics` - its parts.

Nothing is imported here: ``import ragspec.integrations.cli`` (done at every ``ragspec``
start) stays cheap, and LangChain / FastAPI load only when their module is used.
"""

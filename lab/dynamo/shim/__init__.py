"""Lab build of ai-dynamo 1.6.1: ``python -m dynamo.vllm`` runs Dynamo's mocker.

This package replaces upstream's ``dynamo.vllm`` (which imports vLLM) in the lab's
build of the ai-dynamo wheel. See ``lab.py`` and lab/dynamo/README.md.
"""

__version__ = "1.6.1"
LAB_BUILD = True

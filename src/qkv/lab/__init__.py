"""``qkv lab``: train, watch and compare Transformers and RNNs in the browser.

=========================  ======================================================================
part                       what it holds
=========================  ======================================================================
``runs``                   the tasks, the architecture presets, and ``Lab``: ordinary ``qkv train``
                           runs in child processes under ``lab-runs/NAME``, with their bounds
``inside``                 one input through a run's newest checkpoint: output, attention, hidden norms
``lecture``                one attention computation step by step, RNN gates, gradients to the inputs
``panels``                 the lecture panels' numbers (attention, positions, masks, cost, schedule, ...)
``app.create_app``         the FastAPI application: the API under ``/api``, the page (``page.html``)
``server.lab``             the command: the app on 127.0.0.1 until interrupted; the runs stop with it
``child``                  how a run is started: ``qkv ARGS`` that stops when the lab's process ends
=========================  ======================================================================

The lab is a front-end of training, not a second trainer: it starts ``qkv train`` and reads what it
writes (``metrics.jsonl``, ``last/``), so ``qkv translate``, ``viz`` and ``export`` work on its runs.
"""

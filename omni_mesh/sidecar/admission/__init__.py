"""Admission of work into the pod: the queue's pure logic (``queue``), its asyncio gate
(``gate``), a request's admission facts and its slot (``admit``), shedding at arrival
(``early_shed``), the outcome counters (``outcomes``) and the load the pod's heartbeats
report (``load_report``)."""

"""Accounting: where each rank's step goes, and the chain of events that sets its length.

This module is the vocabulary of every output: the summary, ``results.json``, the
PNGs, ``compare``, ``diff``, ``sweep`` and the analytic method all use its
category names and nothing else.

**The breakdown.** For every simulated rank, ``[0, step_time]`` is partitioned
into disjoint :data:`CATEGORIES` that sum to the step time exactly. The rank's
compute stream is its timeline: while it runs a task, the time goes to the
task's category (a fused backward ``B`` is split into its input- and
weight-gradient shares); a collective on the compute stream is *peer-wait* from
the rank's arrival until the last member arrives (``comm_start``) and
*transfer* after. An idle gap before a task is explained by walking back along
what the task waited for: the dependency that ended last, then what that one
waited for, and so on. A transfer in flight is ``<kind>_transfer``; a
collective waiting for its peers is ``<kind>_wait``; reaching compute on
another rank through a pipeline send is pipeline idle (the rank had nothing to
do until a neighbour stage produced its input); reaching the host's optimizer
(ZeRO-Offload's CPU Adam) is ``optimizer``, and so is gradient compression's work on
the ``dp`` stream; FSDP2's copies on the ``zero`` and ``dp`` streams are their pass's
(forward, backward) or ``optimizer`` (the gradient accumulate); the walk continues
past such kernels to what they waited for. The idle after a
rank's last task is pipeline idle until its pipeline's last backward ends (the drain: peer-waits
there are the drain's too) and ``tail`` after it (waiting for other ranks'
optimizer or synchronisation).

**Bubble versus imbalance.** Pipeline idle is split with the schedule's closed
form: ``pipeline_bubble`` is at most the idle the schedule imposes on a rank
whose every stage ran at this rank's own speed (its busy time per micro-batch
in forward, backward-input and backward-weight, communication on the compute
stream included); what exceeds it is ``imbalance_idle``. With balanced stages
and free communication the bubble is exactly the closed form and
``bubble_fraction`` (the mean schedule bubble over ranks / pipeline phase, see
:func:`schedule_bubble`) equals (p − 1)/(m + p − 1) for GPipe and 1F1B, as in
the analytic method.

**The critical path.** From the event that ends last, walk back: a task's own
time is on the path; a collective's wait jumps to the member that arrived last;
otherwise the predecessor is whichever of its dependencies and its stream
predecessor ended last. The segments cover ``[0, step_time]`` and their
composition by category (``critical_path_s``) sums to the step time.

Everything here reads plain data: task records, their spans and the moments
collectives began to transfer.

Modules: ``vocabulary`` (the categories, built-in and added by strategies), ``timing``
(spans as arrays), ``breakdown`` (each rank's partition of the step), ``critical_path``
and ``metrics`` (what results.json derives from the breakdown).
"""

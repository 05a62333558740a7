"""Pipeline schedules as plain data: per-rank actions (``action``), one module per
schedule with its builder and traits (``gpipe``, ``one_f_one_b``, ``interleaved``,
``zb_h1``, ``zbv``, ``dualpipe``), the registry by name
(``registry``), the list-scheduling executor (``execute``) and the consistency checks
(``validate``). Nothing here knows SimPy or transformers.
"""

"""``msn-index``: the offline tools around the live index store, run while msn-serve is stopped.

Building an index from msn-embed shards (:mod:`.build`), re-embedding one for another model or moving it to Milvus
(:mod:`.migrate`), the checked copies into Milvus swapped in under the name (:mod:`.milvus_copy`) and the command
line (:mod:`.cli`). They write what :mod:`msn_serve.indexes` loads, and import it; the live store never imports
them, so a serving process loads none of them.
"""

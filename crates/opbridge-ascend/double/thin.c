/* Thin forwarding library (libacl_rt.so / libascendcl.so): no code of its own; its DT_NEEDED on
 * libacl_rt_impl.so makes dlsym(handle, "aclrtMalloc") resolve into the one implementation. */
int acldouble_thin_library_marker_ __attribute__((visibility("hidden")));

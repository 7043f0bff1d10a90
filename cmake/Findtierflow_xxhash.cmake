# Finds xxHash (no CMake config of its own) and defines the imported target
# tierflow::xxhash that tierflow's exported targets link. Searched in
# CMAKE_PREFIX_PATH, then the system (Debian: libxxhash-dev).
find_path(TIERFLOW_XXHASH_INCLUDE_DIR xxhash.h)
find_library(TIERFLOW_XXHASH_LIBRARY xxhash)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(tierflow_xxhash REQUIRED_VARS TIERFLOW_XXHASH_LIBRARY TIERFLOW_XXHASH_INCLUDE_DIR
                                  REASON_FAILURE_MESSAGE "install the Debian package libxxhash-dev or add its prefix to CMAKE_PREFIX_PATH")
if(tierflow_xxhash_FOUND AND NOT TARGET tierflow::xxhash)
  add_library(tierflow::xxhash UNKNOWN IMPORTED)
  set_target_properties(tierflow::xxhash PROPERTIES IMPORTED_LOCATION "${TIERFLOW_XXHASH_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${TIERFLOW_XXHASH_INCLUDE_DIR}")
endif()

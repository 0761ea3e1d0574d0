package devcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	memory "k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
)

// Manifests reads the Kubernetes objects of YAML files (several documents
// per file allowed). A directory stands for its *.yaml files in name order.
func Manifests(paths ...string) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, p := range paths {
		files := []string{p}
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			files, err = filepath.Glob(filepath.Join(p, "*.yaml"))
			if err != nil {
				return nil, err
			}
			sort.Strings(files)
		}
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				return nil, err
			}
			dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
			for i := 0; ; i++ {
				var u unstructured.Unstructured
				if err := dec.Decode(&u.Object); err != nil {
					if errors.Is(err, io.EOF) {
						break
					}
					return nil, fmt.Errorf("%s: document %d: %w", f, i+1, err)
				}
				if len(u.Object) == 0 {
					continue
				}
				if u.GetKind() == "" || u.GetAPIVersion() == "" {
					return nil, fmt.Errorf("%s: document %d: apiVersion and kind are required", f, i+1)
				}
				objs = append(objs, &u)
			}
		}
	}
	return objs, nil
}

// Apply creates the objects; namespaced ones without a namespace go into
// namespace. Objects that exist already are left as they are.
func (c *Cluster) Apply(ctx context.Context, namespace string, objs []*unstructured.Unstructured) error {
	dyn, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		return err
	}
	disc, err := discovery.NewDiscoveryClientForConfig(c.RESTConfig)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))
	for _, obj := range objs {
		gvk := obj.GroupVersionKind()
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return fmt.Errorf("%s %s: %w", gvk.Kind, obj.GetName(), err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
		if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
			if obj.GetNamespace() == "" {
				obj.SetNamespace(namespace)
			}
			ri = dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace())
		}
		if _, err := ri.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			if apierrors.IsAlreadyExists(err) {
				continue
			}
			return fmt.Errorf("create %s %s: %w", gvk.Kind, obj.GetName(), err)
		}
	}
	return nil
}

// ApplyFiles is Manifests followed by Apply.
func (c *Cluster) ApplyFiles(ctx context.Context, namespace string, paths ...string) ([]*unstructured.Unstructured, error) {
	objs, err := Manifests(paths...)
	if err != nil {
		return nil, err
	}
	return objs, c.Apply(ctx, namespace, objs)
}

{{- define "shardflow.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardflow.labels" -}}
app.kubernetes.io/name: shardflow
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "shardflow.secret" -}}
{{- .Values.connection.existingSecret | default (printf "%s-connection" (include "shardflow.name" .)) -}}
{{- end -}}

{{- define "shardflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "shardflow.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "shardflow.name" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/*
The queue and key prefix. The default carries the release name, so two releases on one broker
never share queues; a long name is cut and made unique again with a hash (32 characters at
most, the limit shardflow's settings accept).
*/}}
{{- define "shardflow.prefix" -}}
{{- if .Values.prefix -}}
{{- .Values.prefix -}}
{{- else -}}
{{- $prefix := printf "sf-%s" .Release.Name -}}
{{- if gt (len $prefix) 32 -}}
{{- $prefix = printf "%s-%s" ($prefix | trunc 23 | trimSuffix "-") (sha256sum .Release.Name | trunc 8) -}}
{{- end -}}
{{- $prefix -}}
{{- end -}}
{{- end -}}

{{/* checkov skips, with the reasons that hold for every shardflow pod (no '=' in a reason). */}}
{{- define "shardflow.checkovSkips" -}}
{{- if not .Values.probes.enabled }}
checkov.io/skip1: CKV_K8S_8=no liveness probe, the chart was installed with probes.enabled false
checkov.io/skip2: CKV_K8S_9=no readiness probe, the chart was installed with probes.enabled false
{{- end }}
checkov.io/skip3: CKV_K8S_35=shardflow reads its connection URLs from SHARDFLOW_* environment variables only, taken from a Secret by secretKeyRef
checkov.io/skip4: CKV_K8S_43=the image is set by tag, pin one by giving image.tag as TAG@sha256:DIGEST
checkov.io/skip5: CKV_K8S_15=IfNotPresent with immutable release tags, set image.pullPolicy to Always for moving tags
checkov.io/skip6: {{ include "shardflow.checkovNamespace" . }}
{{- end -}}

{{- define "shardflow.checkovNamespace" -}}
CKV_K8S_21=resources go to the release namespace (helm install -n), which is default only in a bare render
{{- end -}}

{{/*
One pod spec for every process. The caller gives "root", "component", "args", "spec" (the
component's values: resources, nodeSelector, tolerations, affinity, topologySpreadConstraints,
podAntiAffinity) and, for an orchestrator, "shard".
*/}}
{{- define "shardflow.pod" -}}
{{- $ := .root -}}
{{- $spec := .spec -}}
{{- $selector := dict "app.kubernetes.io/instance" $.Release.Name "app.kubernetes.io/component" .component -}}
{{- with .shard }}{{ $_ := set $selector "shardflow/shard" . }}{{ end -}}
metadata:
  labels:
    {{- include "shardflow.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with .shard }}
    shardflow/shard: {{ . | quote }}
    {{- end }}
    {{- with $.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # A change of the settings or of the chart-made Secret restarts every pod, so all agree.
    checksum/config: {{ include (print $.Template.BasePath "/config.yaml") $ | sha256sum }}
    checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") $ | sha256sum }}
    {{- with $.Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "shardflow.serviceAccount" $ }}
  # shardflow never calls the Kubernetes API.
  automountServiceAccountToken: false
  # No Service's address in the environment: a Service named `shardflow-...` (the metrics one
  # of a release named shardflow) would put SHARDFLOW_* variables there that no setting reads.
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ add $.Values.gracePeriodSeconds 10 }}
  {{- with $.Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: {{ .component }}
      image: {{ include "shardflow.image" $ | quote }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      args:
        {{- toYaml .args | nindent 8 }}
      envFrom:
        - configMapRef:
            name: {{ include "shardflow.name" $ }}-config
      env:
        - name: SHARDFLOW_AMQP_URL
          valueFrom:
            secretKeyRef:
              name: {{ include "shardflow.secret" $ }}
              key: amqp-url
        - name: SHARDFLOW_REDIS_URL
          valueFrom:
            secretKeyRef:
              name: {{ include "shardflow.secret" $ }}
              key: redis-url
        {{- with $.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      # /metrics, /livez, /healthz and /readyz (SHARDFLOW_METRICS_PORT, from the ConfigMap).
      ports:
        - name: metrics
          containerPort: {{ $.Values.metrics.port }}
      {{- with $.Values.probes }}
      {{- if .enabled }}
      # Startup (/livez): until the process reached RabbitMQ and Redis, which it does before
      # it serves anything; not /healthz, which an outage just after that turns red, and the
      # pod would be killed into CrashLoopBackOff. Liveness (/livez): restart a process whose
      # event loop stopped turning, and only that: a restart does not bring RabbitMQ or Redis
      # back (the clients reconnect by themselves) but would cancel the running handlers.
      # Readiness (/readyz): healthy and consuming (not while it stops and finishes what it
      # holds, nor while RabbitMQ or Redis is away).
      startupProbe:
        httpGet: {path: /livez, port: metrics}
        periodSeconds: 5
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ div (add .startupSeconds 4) 5 }}
      livenessProbe:
        httpGet: {path: /livez, port: metrics}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .livenessFailureThreshold }}
      readinessProbe:
        httpGet: {path: /readyz, port: metrics}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .readinessFailureThreshold }}
      {{- end }}
      {{- end }}
      {{- with $spec.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- with $.Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    # The only writable path: the root filesystem is read-only.
    - name: tmp
      emptyDir:
        sizeLimit: {{ $.Values.tmpSizeLimit }}
    {{- with $.Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with ($spec.nodeSelector | default $.Values.nodeSelector) }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with ($spec.tolerations | default $.Values.tolerations) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $affinity := deepCopy ($spec.affinity | default $.Values.affinity | default dict) }}
  {{- $mode := $spec.podAntiAffinity | default "none" }}
  {{- if and (ne $mode "none") (not (hasKey $affinity "podAntiAffinity")) }}
  {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" $selector) }}
  {{- if eq $mode "required" }}
  {{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
  {{- else }}
  {{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
  {{- end }}
  {{- end }}
  {{- with $affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $spec.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- range . }}
    - {{- toYaml (merge (deepCopy .) (dict "labelSelector" (dict "matchLabels" $selector))) | nindent 6 }}
    {{- end }}
  {{- end }}
{{- end -}}

{{- define "shardflow.appArgs" -}}
{{- range . }}
- --app
- {{ . }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget: "root", "name", "component", and for an orchestrator "shard". */}}
{{- define "shardflow.pdb" -}}
{{- $ := .root -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "shardflow.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  maxUnavailable: {{ $.Values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      app.kubernetes.io/instance: {{ $.Release.Name }}
      app.kubernetes.io/component: {{ .component }}
      {{- with .shard }}
      shardflow/shard: {{ . | quote }}
      {{- end }}
{{- end -}}
